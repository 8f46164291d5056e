"""torchtitan 0.3.0's own ``Trainer``, started by its own entry point (``torchtitan.train.main``: its config
registry's ``llama3_debugmodel`` and CLI overrides), under ``torchrun --nproc-per-node 2`` on gloo, twice: as
shipped (torch FSDP2's ``fully_shard``) and with ``ragged_optim.fully_shard`` patched in at the one name
torchtitan's FSDP code calls (``torchtitan.distributed.fsdp.fully_shard``). Everything else is torchtitan's:
meta-device build, ``parallelize_llama`` (selective activation checkpointing, a unit per block, ``[norm,
lm_head]`` as one unit, the root), ``to_empty`` + ``init_weights`` on the sharded params, its chunked loss, its
``clip_grad_norm_``, ``OptimizersContainer`` (AdamW) with the warmup/decay LR schedule, its dataloader, and its DCP
``CheckpointManager`` (saved on the way, then resumed from).

What a hub would provide is made in ``tmp_path``: a byte-level BPE ``tokenizer.json`` (+ ``tokenizer_config.json``
naming BOS/EOS) trained on a few hundred generated lines, which are also the dataset (a jsonl folder that
torchtitan's ``c4_test`` loader, ``load_dataset(path, split="train")``, reads from ``--dataloader.dataset_path``).

This file is also the launcher torchrun runs (``__main__`` below): it applies the CPU shims for torchtitan (each
explained where it is made), optionally patches our ``fully_shard`` in, records each step's loss from
torchtitan's ``MetricsProcessor.log`` and calls ``torchtitan.train.main()``."""

import json
import os
import shutil
import subprocess
import sys
import types

STEPS, SAVE_AT = 8, 4


BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"


def _lines(n: int = 400) -> list[str]:
    """Short sentences from a tiny grammar: structure a debug model learns in a few steps."""
    who = ["the cat", "a dog", "my friend", "the old man", "a small bird", "our teacher", "the farmer", "her sister"]
    did = ["saw", "found", "liked", "followed", "painted", "carried", "heard", "called"]
    what = ["the red ball", "a green tree", "the big house", "a quiet river", "the blue car", "an open door"]
    when = ["today", "yesterday", "at night", "in the morning", "after lunch", "every day"]
    return [
        f"{who[i % 8]} {did[(3 * i) % 8]} {what[(5 * i) % 6]} {when[(7 * i) % 6]}, and {who[(i + 3) % 8]} "
        f"{did[(i + 1) % 8]} {what[(i + 2) % 6]} too."
        for i in range(n)
    ]


def _make_assets(root) -> tuple[str, str]:
    """A byte-level BPE tokenizer (what torchtitan's HuggingFaceTokenizer loads from ``hf_assets_path``) and a
    jsonl dataset folder, both from the same lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    lines = _lines()
    tok_dir, data_dir = os.path.join(root, "tokenizer"), os.path.join(root, "data")
    os.makedirs(tok_dir)
    os.makedirs(data_dir)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=384, special_tokens=[BOS, EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(lines, trainer)
    tok.save(os.path.join(tok_dir, "tokenizer.json"))
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": BOS, "eos_token": EOS}, f)
    with open(os.path.join(data_dir, "train.jsonl"), "w") as f:
        f.writelines(json.dumps({"text": line}) + "\n" for line in lines)
    return tok_dir, data_dir


def _shims(kind: str, record: str) -> None:
    import torch

    # torchtitan picks its device at import (``_get_available_device_type() or "cuda"``): make it "cpu" before any
    # other torchtitan module binds the names; the process group then is gloo (torch's default for "cpu"). Its
    # memory monitor asks the device module for a name, a capacity and memory stats, which ``torch.cpu`` lacks:
    # constants (its stats then read -1, "unknown"); its barrier wants an int device index, not "cpu"
    import torchtitan.tools.utils as titan_utils

    cpu = types.ModuleType("torch_cpu_for_torchtitan")
    cpu.__dict__.update(vars(torch.cpu))
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.current_device = lambda: 0
    cpu.get_device_properties = lambda device=None: types.SimpleNamespace(total_memory=1 << 30)
    cpu.memory_stats = lambda device=None: {}
    cpu.reset_peak_memory_stats = cpu.empty_cache = lambda device=None: None
    titan_utils.device_type, titan_utils.device_module = "cpu", cpu

    import torch.nn.functional as F
    import torchtitan.distributed.fsdp as titan_fsdp
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.models.common import attention

    # FlexAttention has no CPU backward: causal SDPA in its place (no document masking: both runs alike). Its
    # argument names are FlexAttention's: torchtitan's local_map wrapper looks them up
    def sdpa(self, q_BLNH, k_BLNH, v_BLNH, *, attention_masks=None, scale=None, enable_gqa=False, **_kw):
        q, k, v = (t.transpose(1, 2) for t in (q_BLNH, k_BLNH, v_BLNH))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa)
        return out.transpose(1, 2)

    attention.FlexAttention.forward = sdpa

    # torchtitan sets a gradient divide factor of 1.0, which FSDP2 turns into PREMUL_SUM: gloo has none, so SUM
    # reductions (what torchtitan's own symmetric-memory path sets), on every FSDPModule, both runs
    disable_division = titan_fsdp.disable_fsdp_gradient_division

    def disable_division_and_force_sum(model):
        disable_division(model)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)

    titan_fsdp.disable_fsdp_gradient_division = disable_division_and_force_sum

    # after step 1 torchtitan shortens the process groups' timeouts with torch.distributed.set_timeout, which this
    # torch does not have: they keep their initial timeout
    import torchtitan.distributed.utils as titan_dist_utils

    titan_dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None

    # observation only: each step's global loss and grad norm, as torchtitan logs them, to a file of ours
    log = MetricsProcessor.log

    def log_and_record(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        if torch.distributed.get_rank() == 0:
            with open(record, "a") as f:
                f.write(json.dumps({"step": step, "loss": global_avg_loss, "grad_norm": grad_norm}) + "\n")
        return log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)

    MetricsProcessor.log = log_and_record

    if kind == "ours":
        import ragged_optim as ro

        titan_fsdp.fully_shard = ro.fully_shard  # the one import torchtitan's FSDP code uses


#: torchtitan's flags for every run: the local assets, a short CPU-sized batch, DCP checkpoints every SAVE_AT steps.
#: ``partial_dtensor`` is torchtitan's classic FSDP2 path (``fully_shard`` on a dp mesh); its default
#: ``spmd_types`` passes ``dp_mesh_dims`` and needs every param a DTensor on the full SPMD mesh, which fails on
#: this CPU setup for torch's own ``fully_shard`` too
_FLAGS = [
    "--training.seq_len", "128", "--training.local_batch_size", "2", "--training.steps", str(STEPS),
    "--checkpoint.enable", "--checkpoint.folder", "ckpt", "--checkpoint.interval", str(SAVE_AT),
    "--parallelism.spmd_backend", "partial_dtensor",
]  # fmt: skip


def _torchrun(tmp_path, assets, kind: str, name: str, *flags: str, nproc: int = 2, start=None) -> list[dict]:
    """One torchtitan run in ``tmp_path/name`` (its dump folder), started from the checkpoint folder ``start`` when
    given (torchtitan loads the latest step in its checkpoint folder); the steps' global losses and grad norms."""
    from ragged_optim.comm.launch import free_port  # (here: torchrun's ranks run this file, FSDP2's without us)

    dump, record = tmp_path / name, tmp_path / f"{name}.jsonl"
    if start is not None:
        shutil.copytree(start, dump / "ckpt" / os.path.basename(start))
    tok, data = assets
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", "--master-port",
           str(free_port()), __file__, kind, str(record), "--hf_assets_path", tok, "--dataloader.dataset_path", data,
           "--dump_folder", str(dump), *_FLAGS, *flags]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"torchtitan {kind} ({name}) exited {proc.returncode}:\n{out[-6000:]}"
    return [json.loads(line) for line in record.read_text().splitlines()] if record.exists() else []


def _gap(a: list[dict], b: list[dict], key: str) -> float:
    assert [r["step"] for r in a] == [r["step"] for r in b]
    return max(abs(x[key] - y[key]) for x, y in zip(a, b))


def test_torchtitan_trainer_with_our_fully_shard_trains_and_resumes_as_with_fsdp2(tmp_path):
    """torchtitan's llama3 trainer, as shipped and with our ``fully_shard`` in torch's place, from one seed
    checkpoint (torchtitan's ``create_seed_checkpoint``: its way to start every parallelism from the same
    weights), 8 steps on 2 ranks: ours loads the seed, trains, and its grad norms and losses stay within the gap
    a differently batched FSDP2 run (gradient accumulation: same samples, other rounding) has from FSDP2's; grads are
    therefore FSDP2's sums, not 1/W of them. Ours then resumes from its own step-4 DCP checkpoint and repeats
    steps 5-8 exactly."""
    from noise_bounds import allowed

    assets = _make_assets(str(tmp_path))
    assert _torchrun(tmp_path, assets, "fsdp2", "seed", "--checkpoint.create_seed_checkpoint",
                     "--parallelism.data_parallel_shard_degree", "1", nproc=1) == []  # fmt: skip
    seed = tmp_path / "seed" / "ckpt" / "step-0"
    fsdp2 = _torchrun(tmp_path, assets, "fsdp2", "fsdp2", start=seed)
    batched = _torchrun(tmp_path, assets, "fsdp2", "fsdp2_accumulated", "--training.local_batch_size", "1",
                        "--training.global_batch_size", "4", start=seed)  # fmt: skip
    ours = _torchrun(tmp_path, assets, "ours", "ours", start=seed)
    assert [r["step"] for r in ours] == list(range(1, STEPS + 1))
    assert ours[0]["loss"] == fsdp2[0]["loss"], "the same seed weights and data give the same first forward"
    for key in ("grad_norm", "loss"):
        gap, reference = _gap(ours, fsdp2, key), _gap(batched, fsdp2, key)
        scale = max(abs(r[key]) for r in fsdp2)
        assert gap <= allowed(reference, scale), (
            f"{key}: ours is {gap:.3g} from FSDP2, FSDP2 batched otherwise {reference:.3g}"
        )
    assert fsdp2[-1]["loss"] < fsdp2[0]["loss"] - 1.0  # (it trains: the gaps above are small against this)
    resumed = _torchrun(tmp_path, assets, "ours", "ours_resumed", start=tmp_path / "ours" / "ckpt" / f"step-{SAVE_AT}")
    assert resumed == ours[SAVE_AT:], "resumed from its own step-4 checkpoint, ours repeats steps 5-8 exactly"


def _main() -> None:
    kind, record, *titan_args = sys.argv[1:]
    _shims(kind, record)
    from torchtitan.train import main

    sys.argv = [sys.argv[0], "--module", "llama3", "--config", "llama3_debugmodel", *titan_args]
    main()


if __name__ == "__main__":
    _main()
