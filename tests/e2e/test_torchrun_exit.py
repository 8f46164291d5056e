"""A run that ends with a no_grad eval forward and destroy_process_group() exits 0 under torchrun.

The cause of the aborts at exit ("terminate called without an active exception", SIGABRT after a run that
succeeded; FSDP2 too): a gloo worker thread that holds a finished collective's last reference needs the GIL to
drop its tensors, and gets it only after interpreter shutdown began (comm/exit_guard.py, where the backtrace is
described). The torchrun runs below are a guard, not a proof (the race needs an unlucky schedule: 11 aborts in
37 runs of tests/support/dcp_torchrun_job.py here without the exit handler, 0 with it); the stand-in test shows the
handler itself, deterministically.
"""

import os
import subprocess
import sys

import pytest

from ragged_optim.comm.launch import free_port

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "scripts", "train_eval_exit.py")
GIL_WAITER = os.path.join(HERE, "scripts", "gil_waiter_at_exit.py")


def _torchrun(which: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port())]
    return subprocess.run(cmd + [SCRIPT, which], capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("attempt", range(2))
def test_train_eval_destroy_exits_zero_under_torchrun(attempt):
    out = _torchrun("ours")
    assert out.returncode == 0, out.stderr[-3000:]


def test_exit_hands_the_gil_to_a_waiting_thread_while_gloo_lives(tmp_path):
    """A thread that waits for the GIL when the script ends (as a gloo worker whose collective just finished)
    runs before interpreter shutdown once ragged_optim.comm is imported; without it (the control, the code before
    comm/exit_guard.py) it never does, which for a gloo worker is the abort."""
    ran = {}
    for mode in ("without", "with-ragged-optim"):
        flag = tmp_path / f"{mode}.flag"
        cmd = [sys.executable, GIL_WAITER, str(flag), str(free_port()), mode]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        ran[mode] = flag.exists()
    assert ran == {"without": False, "with-ragged-optim": True}


def test_exit_guard_waits_only_while_gloo_workers_live():
    """The handler costs nothing in a process whose gloo groups are gone (or never existed)."""
    code = f"""
import gc, time
import torch.distributed as dist
from ragged_optim.comm import exit_guard
assert exit_guard.gloo_worker_threads() == 0
t0 = time.perf_counter(); exit_guard._hand_over_gil(); idle = time.perf_counter() - t0
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
deadline = time.monotonic() + 30  # the workers name themselves once they run, just after init returns
while exit_guard.gloo_worker_threads() == 0 and time.monotonic() < deadline:
    time.sleep(0.01)
live = exit_guard.gloo_worker_threads()
t0 = time.perf_counter(); exit_guard._hand_over_gil(); waited = time.perf_counter() - t0
dist.destroy_process_group(); gc.collect()
print(idle, live, waited, exit_guard.gloo_worker_threads())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    idle, live, waited, after = out.stdout.split()
    assert float(idle) < 0.01 and int(live) >= 1 and float(waited) >= 0.05 and int(after) == 0
