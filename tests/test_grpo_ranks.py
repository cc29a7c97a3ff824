"""GRPO across trainer ranks: `torchrun --nproc-per-node 2` on the CPU, gloo, DDP.

Each test launches `tests/grpo_ranks_job.py` with the real launcher. Nothing stands in for the
process group, the server or the worker.

Tolerance of the gradient test: the one-rank step trains each slot's two micro-batches as one,
so its rows are packed otherwise and its sums run in another order (a packed token's values
differ by float32 ulps with the shape of its row, see test_grpo_packing.py), and the two-rank
gradient is a sum of two partial sums (gloo's all-reduce). Each entry may thus differ by a few
ulps of the terms it sums: the bound is 1e-5 of the largest entry, as for packed against padded
(measured: 6.6e-8 of it when the ranks share the slot; bitwise equal when one rank is idle).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reprorl.grpo import AsyncGRPOConfig
from reprorl.grpo.distributed import by_slot, deal, step_shares, trained_tokens
from reprorl.grpo.identity import refuse_other_run, run_identity

HERE = Path(__file__).parent
GRAD_RTOL = 1e-5  # relative to the largest gradient entry (see the module's docstring)


def torchrun(ranks: int, *args: str, timeout: int = 300) -> str:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc-per-node={ranks}", str(HERE / "grpo_ranks_job.py"), *args],
        capture_output=True, text=True, env=env, timeout=timeout, check=False)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-6000:]
    return done.stdout


class Trained:
    def __init__(self, tokens: int):
        self.sequence = type("Sequence", (), {"trained": [0] + [1] * tokens})()


def test_micro_batches_are_dealt_round_robin_and_slots_count_every_rank():
    batches = [[Trained(3)], [Trained(2), Trained(1)], [Trained(4)]]
    assert [deal(batches, 2, r) for r in (0, 1)] == [[batches[0], batches[2]], [batches[1]]]
    assert [len(by_slot(batches, n)) for n in (2, 1, 4)] == [2, 3, 1]
    assert [trained_tokens(slot) for slot in by_slot(batches, 2)] == [6, 4]
    assert deal(batches[:1], 2, 1) == []  # this rank forwards idle in that step
    # what rank 0 scatters: each rank its own micro-batches, every slot's counts
    shares = step_shares(batches, 2)
    assert [s.microbatches for s in shares] == [deal(batches, 2, r) for r in (0, 1)]
    assert all(s.slot_tokens == [6, 4] and s.slot_ranks == [2, 1] for s in shares)
    (alone,) = step_shares(batches, 1)
    assert alone.microbatches == batches and alone.slot_tokens == [3, 3, 4]


def test_a_checkpoint_resumes_only_with_the_ranks_that_wrote_it(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": "q"}]}]
    one, two = run_identity(args, rows), run_identity(args, rows, world_size=2)
    assert "world_size" not in one and two["world_size"] == 2
    refuse_other_run(tmp_path, two, two, args)
    with pytest.raises(ValueError, match=r"trained by 1 rank\(s\), this run has 2.*"
                                         r"--nproc-per-node 1"):
        refuse_other_run(tmp_path, one, two, args)


@pytest.mark.timeout(300)
def test_two_ranks_give_the_gradient_of_one_rank_on_the_same_global_batch(
        tiny_model, tmp_path):
    """Step 1: three micro-batches (rank 0 has slots 0 and 1, rank 1 slot 0 only); step 2:
    one (rank 1 forwards idle); step 3: the same with average_tokens_across_devices=False,
    whose slot of one micro-batch must not be halved by DDP's mean over two ranks. The
    one-rank step trains each slot's micro-batches as one."""
    torchrun(2, "gradient", str(tiny_model), str(tmp_path))
    torchrun(1, "gradient", str(tiny_model), str(tmp_path))
    one = torch.load(tmp_path / "gradient-world1-rank0.pt")
    two = [torch.load(tmp_path / f"gradient-world2-rank{r}.pt") for r in (0, 1)]
    for alone, together, other in zip(one, *two, strict=True):
        assert alone["slots"] == together["slots"]
        grads = alone["grads"]
        assert grads.keys() == together["grads"].keys()
        assert all(torch.equal(together["grads"][n], other["grads"][n]) for n in grads)
        largest = max(float(g.abs().max()) for g in grads.values())
        worst = max(float((grads[n] - together["grads"][n]).abs().max()) for n in grads)
        assert largest > 0 and worst <= GRAD_RTOL * largest, (worst, largest)
        assert together["loss"] == pytest.approx(alone["loss"], rel=1e-5, abs=1e-7)


@pytest.mark.timeout(600)
def test_two_ranks_train_a_real_run_and_resume_it_bit_for_bit(tiny_model, tmp_path):
    """A fixed-schedule run of 4 steps on 2 ranks (rank 0: server, worker, checkpoints): both
    ranks train samples each step and end on the same policy; interrupted after step 2 and
    resumed by new ranks, it ends where the continuous run does, checkpoint byte for byte."""
    torchrun(2, "train", str(tiny_model), str(tmp_path), "continuous")
    ranks = [torch.load(tmp_path / f"continuous-rank{r}.pt") for r in (0, 1)]
    policy = ranks[0]["policy"]
    assert all(torch.equal(policy[k], ranks[1]["policy"][k]) for k in policy)
    assert ranks[0]["global_step"] == ranks[1]["global_step"] == 4
    assert ranks[0]["loss"] == ranks[1]["loss"]
    lines = [json.loads(line) for line in
             (tmp_path / "continuous/metrics.jsonl").read_text().splitlines()]
    steps = [line for line in lines if "perf/step_s" in line]
    assert len(steps) == 4
    for step, (mine, theirs) in zip(steps, zip(ranks[0]["trained"], ranks[1]["trained"])):
        assert mine > 0 and theirs > 0  # the samples were split
        assert mine + theirs == step["batch/samples_per_step"]
        # rank 1's row records reached rank 0's window: one row per micro-batch here, so
        # the mean over every rank's rows is the step's samples per micro-batch
        assert step["batch/samples_per_row"] == pytest.approx(
            step["batch/samples_per_step"] / step["batch/microbatches_per_step"])

    torchrun(2, "train", str(tiny_model), str(tmp_path), "resumed", "--interrupt", "2")
    assert torch.load(tmp_path / "resumed-rank1.pt")["global_step"] == 2
    out = torchrun(2, "train", str(tiny_model), str(tmp_path), "resumed", "--resume")
    assert "resumed from" in out and out.count("resumed from") == 1  # rank 0 logs
    resumed = torch.load(tmp_path / "resumed-rank1.pt")["policy"]
    assert all(torch.equal(policy[k], resumed[k]) for k in policy)

    def files(folder: Path) -> dict[str, bytes]:
        return {str(p.relative_to(folder)): p.read_bytes()
                for p in sorted(folder.rglob("*")) if p.is_file()}

    assert files(tmp_path / "continuous/checkpoint-4") == files(tmp_path / "resumed/checkpoint-4")
