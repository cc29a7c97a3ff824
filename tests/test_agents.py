"""Agent rollouts (issue 13, items 1-4 and 7): tools, environments, the multi-turn loop and its
metrics; the units first, then real runs (worker, embedded server) of the counter example on
a policy warm-started to call its tool."""

from __future__ import annotations

import asyncio
import functools
import json
import math
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer
from reprorl.grpo.agents import (
    EnvironmentPool,
    call_tool,
    check_prefix_preserving,
    check_tools,
    observe,
    parse_tool_calls,
    probe_environments,
)
from reprorl.grpo.rollout import AsyncRolloutLoop
from reprorl.grpo.samples import TurnRecord, reconcile_turns
from reprorl.pipeline import base_model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))  # the spawned worker inherits sys.path

import counter_env  # noqa: E402
from counter_env import IncrementEnv  # noqa: E402

# ---------------------------------------------------------------- tools and environments


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


async def async_add(a: int, b: int) -> int:
    """Add two integers, awaited.

    Args:
        a: The first.
        b: The second.
    """
    return a + b


def undocumented(a: int) -> int:
    return a


def broken(a: int) -> int:
    """Always raises.

    Args:
        a: Ignored.
    """
    raise ValueError("no luck")


def wait(timeout: float) -> str:
    """Takes an argument named like the call's own timeout.

    Args:
        timeout: Seconds.
    """
    return f"waited {timeout}"


def scaled(completions, k: float, **kwargs):
    return [k] * len(completions)


def slow(a: int) -> int:
    """Sleeps.

    Args:
        a: Ignored.
    """
    time.sleep(2)
    return a


class FaultyEnv(IncrementEnv):
    """Its tool raises; its reset checks what the row hands it."""

    def reset(self, **row) -> None:
        if "environment" in row or "prompt" not in row:
            raise AssertionError(f"reset got {sorted(row)}")
        super().reset(**row)

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: the amount
        """
        raise ValueError(f"counter jammed at step {step}")


class SlowEnv(IncrementEnv):
    """Its tool outruns tool_timeout."""

    def increment(self, step: int) -> int:
        """Add to the counter.

        Args:
            step: the amount
        """
        time.sleep(3)
        return super().increment(step)


class NoResetEnv:
    def act(self, x: int) -> int:
        """Act.

        Args:
            x: How.
        """
        return x


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) for ids in completion_ids]


class RecordingLoop(AsyncRolloutLoop):
    """The default tool loop, each finished rollout appended to <output_dir>/rollouts.jsonl."""

    async def generate_one(self, prompt, tools, group_id=0):
        rollout = await super().generate_one(prompt, tools, group_id)
        record = {"tools": sorted(getattr(t, "__name__", "") for t in tools),
                  "completion": rollout.completion,
                  "turns": [[t.prompt_ids, t.output_ids, t.finish_reason]
                            for t in rollout.turns],
                  "logprobs": [t.output_log_probs for t in rollout.turns],
                  "calls": [[c.name, c.failed, c.unknown, c.result]
                            for c in rollout.tool_calls],
                  "exhausted": rollout.loop_exhausted}
        with open(Path(self.config.output_dir) / "rollouts.jsonl", "a") as handle:
            handle.write(json.dumps(record) + "\n")
        return rollout


def test_tool_calls_parse_as_qwen_writes_them():
    text = ('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
            '\n<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 3, \\"b\\": 4}"}\n'
            '</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Sure."
    assert calls == [{"name": "add", "arguments": {"a": 1, "b": 2}},
                     {"name": "add", "arguments": {"a": 3, "b": 4}}]
    for malformed in ('<tool_call>\n{"name": "add", "arguments": {"a": 1\n</tool_call>',
                      '<tool_call>{"arguments": {}}</tool_call>', "<tool_call>[1]</tool_call>",
                      '<tool_call>\n{"name": "add"', "no call at all"):
        assert parse_tool_calls(malformed) == (malformed, [])  # plain text: nothing called


def test_tools_are_checked_by_name_schema_and_picklability():
    assert check_tools([add, async_add]) == [add, async_add]
    with pytest.raises(TypeError, match="lambda or a closure"):
        check_tools([lambda a: a])

    def local(a: int) -> int:
        """Local.

        Args:
            a: A.
        """
        return a

    with pytest.raises(TypeError, match="module level"):
        check_tools([local])
    with pytest.raises(ValueError, match="undocumented.*Google-style docstring"):
        check_tools([undocumented])
    with pytest.raises(ValueError, match="two tools are named 'add'"):
        check_tools([add, add])
    with pytest.raises(TypeError, match="no reset"):
        probe_environments({None: NoResetEnv})
    assert probe_environments({"a": IncrementEnv, "b": FaultyEnv}) == {"a": True, "b": True}
    with pytest.raises(ValueError, match="environment 'a' method 'increment' has the name of a "
                                         "tool in tools"):
        probe_environments({"a": IncrementEnv}, check_tools([increment]))


def increment(step: int) -> int:
    """A standalone tool with the name of IncrementEnv's method.

    Args:
        step: what to return
    """
    return step


class MakeCounter:
    """A callable instance as environment factory (picklable, as the worker needs)."""

    def __call__(self):
        return IncrementEnv()


def test_rollout_parts_are_named_by_module_and_class_without_addresses():
    trainer = AsyncGRPOTrainer.__new__(AsyncGRPOTrainer)  # _sources reads these four only
    trainer.reward_funcs, trainer.tools = [functools.partial(add, b=1)], [add]
    trainer.environment_factory = {"a": IncrementEnv, "b": MakeCounter()}
    trainer.loop_cls = AsyncRolloutLoop
    assert trainer._sources() == {
        "reward_funcs": ["add"], "tools": ["add"],
        "environments": {"a": "counter_env.IncrementEnv", "b": f"{__name__}.MakeCounter"},
        "loop_cls": "reprorl.grpo.rollout.AsyncRolloutLoop"}


def test_a_checkpoint_refuses_a_resume_with_other_rollout_parts(tmp_path):
    from reprorl.grpo.identity import refuse_other_run, run_identity

    args, rows = AsyncGRPOConfig(output_dir=str(tmp_path)), [{"prompt": "p"}]
    parts = {"reward_funcs": ["r"], "tools": ["add"], "environments": {},
             "loop_cls": "reprorl.grpo.rollout.AsyncRolloutLoop"}
    state = run_identity(args, rows, sources=parts)
    refuse_other_run(tmp_path, state, run_identity(args, rows, sources=dict(parts)), args)
    other = run_identity(args, rows, sources={**parts, "tools": ["add", "broken"]})
    with pytest.raises(ValueError, match=r"other rollout parts \(tools: \['add'\] -> "):
        refuse_other_run(tmp_path, state, other, args)


def test_calls_run_sync_async_and_fail_without_stopping_the_rollout():
    tools = {f.__name__: f for f in (add, async_add, broken, slow, wait)}

    async def run():
        with ThreadPoolExecutor(4) as pool:
            return await asyncio.gather(
                call_tool(tools, "add", {"a": 1, "b": 2}, pool, 1.0),
                call_tool(tools, "async_add", {"a": 1, "b": 2}, pool, 1.0),
                call_tool(tools, "broken", {"a": 1}, pool, 1.0),
                call_tool(tools, "slow", {"a": 1}, pool, 0.2),
                call_tool(tools, "add", {"c": 1}, pool, 1.0),
                call_tool(tools, "nope", {}, pool, 1.0),
                call_tool(tools, "wait", {"timeout": 2}, pool, 1.0))

    ok, awaited, raised, late, bad_args, unknown, named = asyncio.run(run())
    assert (named.result, named.failed) == ("waited 2", False)
    assert late.timed_out and not raised.timed_out
    assert (ok.result, ok.failed, awaited.result) == ("3", False, "3")
    assert raised.failed and json.loads(raised.result) == {"error": "ValueError: no luck"}
    assert late.failed and "timed out after 0.2 s" in late.result
    assert bad_args.failed and "TypeError" in bad_args.result
    assert unknown.failed and unknown.unknown and "no tool named 'nope'" in unknown.result


def test_every_reward_source_counts_also_two_of_one_name():
    """Two partials of one function are two sources (their metrics share a name); an
    environment's get_reward and Rollout.reward are summed with them."""
    from reprorl.grpo.samples import RolloutGroup

    loop = AsyncRolloutLoop.__new__(AsyncRolloutLoop)  # _reward reads these three only
    loop.reward_funcs = [functools.partial(scaled, k=1.0), functools.partial(scaled, k=10.0)]
    loop.config, loop.reward_pool = AsyncGRPOConfig(), ThreadPoolExecutor(2)
    group = RolloutGroup(
        prompts=[[], []], reward_kwargs={}, completions=[[{"content": ""}]] * 2,
        completions_ids=[[1], [2]], completions_sequences=[[], []], model_version=0,
        group_id=0, row_index=0, rollout_rewards=[None, 0.5],
        env_rewards=[(IncrementEnv, 2.0), None])
    asyncio.run(loop._reward(group))
    assert group.rewards.tolist() == [13.0, 11.5]
    assert group.reward_by_func["IncrementEnv"][0] == 2.0
    assert math.isnan(group.reward_by_func["IncrementEnv"][1])


class SelfServingEnv(IncrementEnv):
    """The seed's environment without a dataset: reset() makes the task and the prompt."""

    def reset(self, **row) -> str:
        if row:
            raise AssertionError(f"an empty row was expected, got {row}")
        self.counter, self.target = 0, 3
        return "Increment the counter to 3."


def test_environments_route_by_column_and_reset_extends_the_prompt():
    pool = EnvironmentPool({"counter": IncrementEnv, "faulty": FaultyEnv})
    assert pool.key_of({"environment": "faulty"}) == "faulty"
    with pytest.raises(ValueError, match="environment='game'.*\\['counter', 'faulty'\\]"):
        pool.key_of({"environment": "game"})
    first = pool.take("counter")
    pool.give_back("counter", first)
    assert pool.take("counter") is first  # reused across episodes
    assert pool.take("counter") is not first  # a second rollout in flight gets its own
    prompt = [{"role": "user", "content": "Go."}]
    assert observe(prompt, " Target 3.") == [{"role": "user", "content": "Go. Target 3."}]
    assert prompt == [{"role": "user", "content": "Go."}]  # the row is left as it was
    assert observe(None, "Reach 4.") == [{"role": "user", "content": "Reach 4."}]


# old: the embedded template before tools, kept here to prove plain chats render the same
OLD_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}"
    "<|im_start|>system\n" + base_model.SYSTEM_PROMPT + "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def assert_renders_tools_as_the_parser_reads_them(tokenizer) -> str:
    """The checks the trainer makes, then a conversation with two calls and their results:
    the schema is rendered, and the parser reads back the calls the template wrote."""
    check_prefix_preserving(tokenizer)
    call = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "sum"}, {"role": "assistant", "content": "", "tool_calls":
                                              [call, call]},
         {"role": "tool", "name": "add", "content": "3"},
         {"role": "tool", "name": "add", "content": "3"}],
        tools=[add], tokenize=False, add_generation_prompt=True)
    assert '"name": "add", "description": "Add two integers."' in text
    reply = text.split("<|im_start|>assistant\n")[-2].split("<|im_end|>")[0]
    assert parse_tool_calls(reply)[1] == [call["function"], call["function"]]
    assert text.count("<tool_response>\n3\n</tool_response>") == 2
    return text


QWEN = ROOT / "assets/qwen2.5-0.5b-instruct"  # configs/qwen2.5-0.5b.yaml's model.path


@pytest.mark.skipif(not (QWEN / "tokenizer_config.json").is_file(),
                    reason=f"Qwen2.5-0.5B-Instruct's files are not at {QWEN} (no hub here)")
def test_qwen_s_own_template_renders_tools_as_the_parser_reads_them():
    from transformers import AutoTokenizer

    assert_renders_tools_as_the_parser_reads_them(AutoTokenizer.from_pretrained(QWEN))


def test_the_embedded_template_renders_tools_and_leaves_plain_chats_as_they_were(tiny_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    chats = [[{"role": "user", "content": "hi"}],
             [{"role": "system", "content": "S"}, {"role": "user", "content": "hi"},
              {"role": "assistant", "content": "yo"}, {"role": "user", "content": "again"}]]
    for chat in chats:
        for generation in (True, False):
            assert tokenizer.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=generation) == (
                tokenizer.apply_chat_template(chat, tokenize=False, chat_template=OLD_TEMPLATE,
                                              add_generation_prompt=generation))
    text = assert_renders_tools_as_the_parser_reads_them(tokenizer)
    assert text.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
        '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n3\n</tool_response>\n'
        '<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n')
    tokenizer.chat_template = OLD_TEMPLATE
    with pytest.raises(ValueError, match="does not render tools"):
        check_prefix_preserving(tokenizer)


def test_tool_messages_are_context_and_every_generated_token_trains_once():
    turns = [TurnRecord([1, 2], [3, 4]), TurnRecord([1, 2, 3, 4, 9, 9], [5]),  # extends
             TurnRecord([1, 2, 7, 9], [6, 8])]  # re-rendered: a fork
    sequences, drifts = reconcile_turns(turns)
    assert drifts == [0, 5]
    assert [s.input_ids for s in sequences] == [[1, 2, 3, 4, 9, 9, 5], [1, 2, 7, 9, 6, 8]]
    assert [s.trained for s in sequences] == [[0, 0, 1, 1, 0, 0, 1], [0, 0, 0, 0, 1, 1]]


def test_no_reward_source_is_refused_when_training_starts(tiny_model, tmp_path):
    class Unscored(IncrementEnv):
        get_reward = None

    trainer = AsyncGRPOTrainer(model=str(tiny_model), train_dataset=counter_env.rows(1),
                               args=counter_env_args(tmp_path), environment_factory=Unscored)
    with pytest.raises(ValueError, match="nothing scores a completion"):
        trainer.train()
    assert not (tmp_path / "out").exists()


def counter_env_args(tmp_path):
    from reprorl.grpo import AsyncGRPOConfig

    return AsyncGRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, disable_tqdm=True)


def test_an_environment_without_a_dataset_needs_max_steps(tiny_model):
    from reprorl.grpo import AsyncGRPOConfig

    with pytest.raises(ValueError, match="set max_steps > 0"):
        AsyncGRPOTrainer(model=str(tiny_model), args=AsyncGRPOConfig(output_dir="x"),
                         environment_factory=IncrementEnv)


# ---------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def tool_caller(tiny_model, tmp_path_factory) -> Path:
    """The CI base, warm-started on the example's demonstrations (about 20 s)."""
    return counter_env.warm_start(tiny_model, tmp_path_factory.mktemp("agents") / "policy")


def read_lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def windows(output: Path) -> list[dict]:
    return [w for w in read_lines(output / "metrics.jsonl") if "loss" in w]


# the counter runs sample with top-k/top-p: tools and candidate sets together
TRUNCATED = {"top_k": 20, "top_p": 0.95}


@pytest.fixture(scope="module")
def counter_run(tool_caller, tmp_path_factory):
    output = tmp_path_factory.mktemp("counter") / "out"
    started = time.monotonic()
    counter_env.train(tool_caller, output, max_steps=3, loop_cls=RecordingLoop,
                      log=lambda message: None, **TRUNCATED)
    return output, time.monotonic() - started


@pytest.mark.timeout(240)
def test_the_counter_example_calls_executes_masks_and_counts_its_tool(counter_run,
                                                                      tool_caller):
    output, seconds = counter_run
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_caller)
    rollouts = read_lines(output / "rollouts.jsonl")
    called = [r for r in rollouts if r["calls"]]
    assert len(called) >= len(rollouts) // 2, "the warm start should call its tool"
    for rollout in rollouts:
        assert rollout["tools"] == ["increment"]  # the environment's method, nothing else
        turns = [TurnRecord(p, o, finish_reason=f) for p, o, f in rollout["turns"]]
        texts = [tokenizer.decode(o) for _, o, _ in rollout["turns"]]
        # parsed: every call of a turn the loop went on from, executed in the environment
        written = [c for text in texts[:-1] for c in parse_tool_calls(text)[1]]
        assert [c[0] for c in rollout["calls"]] == [c["name"] for c in written]
        counter = 0
        for (name, failed, unknown, result), call in zip(rollout["calls"], written):
            assert (name, failed, unknown) == ("increment", False, False)
            counter += call["arguments"]["step"]
            assert result == str(counter)
        # masked: the tool's answer is in the next turn's prompt, never a trained token
        sequences, _ = reconcile_turns(turns)
        generated = sum(len(o) for _, o, _ in rollout["turns"])
        assert sum(sum(s.trained) for s in sequences) == generated  # each trained once
        if rollout["calls"]:
            answer = tokenizer(f"<tool_response>\n{rollout['calls'][0][3]}\n</tool_response>",
                               add_special_tokens=False)["input_ids"]
            second = turns[1].prompt_ids
            start = next(i for i in range(len(second))
                         if second[i:i + len(answer)] == answer)
            trained = sequences[-1].trained
            assert not any(trained[start:start + len(answer)])
    # counted: the windows agree with the rollouts of the positions trained
    lines = windows(output)
    assert len(lines) == 3
    calls = sum(w["tools/increment/call_count"] for w in lines)
    assert calls > 0 and sum(w["tools/unknown_name_count"] for w in lines) == 0
    for w in lines:
        assert w["tools/failure_frequency"] == 0.0 and w["tools/loop_exhausted_frac"] == 0.0
        assert 0 < w["tools/call_frequency"] <= 1 and w["tools/parallel_calls_mean"] == 1.0
        assert "rewards/IncrementEnv/mean" in w
    for name in ("env/reset_s", "env/reward_s", "tools/latency_s", "tools/increment/latency_s",
                 "rollout/turns_mean", "rollout/turns_max"):  # timings: the worker's queue
        assert any(name in w for w in lines), name
    assert max(w.get("rollout/turns_max", 0) for w in lines) == 2.0
    # step 1 trains samples of the policy it samples with (schedule_lag=1 makes later steps
    # one version stale): renormalised over the sets, its ratios are 1 to float error
    assert abs(lines[0]["sampling/importance_sampling_ratio/mean"] - 1) < 1e-4
    print(json.dumps({"counter_example_s": round(seconds, 1), "windows": [
        {k: w.get(k) for k in ("step", "reward", "tools/call_frequency", "rollout/turns_mean",
                               "tools/increment/call_count")} for w in lines]}))


@pytest.mark.timeout(240)
def test_a_pure_tool_and_truncation_keep_a_fixed_schedule_run_bitwise_reproducible(
        counter_run, tool_caller, tmp_path):
    """Found on the way: before the loss gathered its columns with index_select, these runs
    ended on other bits run to run (advanced indexing's backward adds with CPU atomics)."""
    first, _ = counter_run
    second = tmp_path / "again"
    counter_env.train(tool_caller, second, max_steps=3, loop_cls=RecordingLoop,
                      log=lambda message: None, **TRUNCATED)
    checkpoint = first / "checkpoint-3"
    files = sorted(p.relative_to(checkpoint) for p in checkpoint.rglob("*") if p.is_file())
    assert files, "the run saved no checkpoint at step 3"
    for name in files:
        assert (checkpoint / name).read_bytes() == (
            second / "checkpoint-3" / name).read_bytes(), name
    from reprorl.grpo.metrics import reproducible

    def content(lines):
        return [{k: v for k, v in w.items() if reproducible(k)} for w in lines]

    assert content(windows(first)) == content(windows(second))


@pytest.mark.timeout(240)
def test_routing_failing_and_slow_tools_and_a_template_that_forks(tool_caller, tmp_path):
    """Rows pick their environment by column; a raising tool and a tool past tool_timeout
    fail the call, not the run; a template that re-renders the arguments otherwise than the
    model wrote them forks every tool turn into a new sample."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tool_caller)
    tokenizer.chat_template = tokenizer.chat_template.replace(
        "call['arguments'] | tojson }}", "call['arguments'] | tojson(indent=1) }}")
    rows = counter_env.rows(1)
    for row, name in zip(rows, ["counter", "faulty", "slow"] * 2):
        row["environment"] = name
    output = tmp_path / "out"
    counter_env.train(
        tool_caller, output, max_steps=1, loop_cls=RecordingLoop, log=lambda message: None,
        train_dataset=rows, reward_funcs=length_reward, processing_class=tokenizer,
        environment_factory={"counter": IncrementEnv, "faulty": FaultyEnv, "slow": SlowEnv},
        tool_timeout=0.5, num_generations=4, groups_per_step=6)  # every row in the one step
    rollouts = read_lines(output / "rollouts.jsonl")
    results = [c[3] for r in rollouts for c in r["calls"]]
    assert any("ValueError: counter jammed" in r for r in results)
    assert any("increment timed out after 0.5 s" in r for r in results)
    assert any(r.isdigit() for r in results)
    lines = windows(output)
    assert sum(w["tools/increment/failure_count"] for w in lines) > 0
    assert any(0 < w["tools/failure_frequency"] for w in lines)
    # every rollout that called a tool was re-rendered differently: two samples
    from reprorl.grpo.samples import reconcile_turns as reconcile

    multi = [r for r in rollouts if len(r["turns"]) > 1]
    assert multi
    for rollout in multi:
        turns = [TurnRecord(p, o) for p, o, _ in rollout["turns"]]
        sequences, drifts = reconcile(turns)
        assert len(sequences) == len(turns) and all(d > 0 for d in drifts)
        assert sum(sum(s.trained) for s in sequences) == sum(len(t.output_ids) for t in turns)
    assert torch.isfinite(torch.tensor([w["loss"] for w in lines])).all()


@pytest.mark.timeout(240)
def test_an_environment_without_a_dataset_makes_its_own_prompts(tool_caller, tmp_path):
    """No train_dataset: rows are an endless stream of empty rows; each reset() writes the
    prompt. Groups whose rewards all agree are dropped without stopping the run."""
    output = tmp_path / "out"
    counter_env.train(tool_caller, output, max_steps=2, loop_cls=RecordingLoop,
                      log=lambda message: None, train_dataset=None,
                      environment_factory=SelfServingEnv, schedule_lag=None)
    rollouts = read_lines(output / "rollouts.jsonl")
    assert rollouts and all(r["tools"] == ["increment"] for r in rollouts)
    lines = windows(output)
    assert len(lines) == 2 and all("epoch" not in w for w in lines)
