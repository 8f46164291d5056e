"""A process that ends while a thread waits for the GIL, as a gloo worker does when its collective has just
finished (comm/exit_guard.py). Not a test itself: tests/e2e/test_torchrun_exit.py runs it.

python gil_waiter_at_exit.py FLAG_PATH PORT with-ragged-optim|without

The thread writes FLAG_PATH once it holds the GIL. The main thread keeps the GIL from the moment the thread wants
it (a switch interval of 1000 s) to the end of the script, so the thread gets the GIL before interpreter shutdown
only if an exit handler hands it over; a real gloo worker that gets it after shutdown began aborts the process.
"""

import os
import sys
import threading
import time

import torch.distributed as dist


def gloo_workers_named() -> bool:
    """Whether gloo's worker threads have started and named themselves (they do so just after init returns).
    comm/exit_guard.py counts them the same way; importing it here would install the handler this script is
    run without."""
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "pt_gloo_runloop":
                    return True
        except OSError:
            pass
    return False


path, port, mode = sys.argv[1], sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
deadline = time.monotonic() + 30
while not gloo_workers_named() and time.monotonic() < deadline:
    time.sleep(0.01)
if mode == "with-ragged-optim":
    import ragged_optim.comm  # noqa: F401  (what any use of the library imports)
lock = threading.Lock()
lock.acquire()


def worker():
    with lock:
        with open(path, "w") as f:
            f.write("ran")


threading.Thread(target=worker, daemon=True).start()
sys.setswitchinterval(1000.0)
lock.release()  # the worker wakes and now waits for the GIL
