"""`AsyncRolloutLoop`, the rollout worker's class to subclass: its hooks and their defaults.

Each prompt passes, in order, through `filter_prompt` -> `num_generations` x `generate_one`
(each calling `generate_one_turn` per sampling request) -> scoring of the complete group ->
`compute_advantages` -> the drop rule -> samples onto the trainer's queue. Subclass it, override
a hook, and set the subclass as the trainer's `loop_cls` (define it at module level: the loop is
built in the spawned process). What the hooks take and return (`TurnRecord`, `Rollout`,
`RolloutGroup`) and what reaches the trainer (`Sample`, `GroupResult`) are plain data, in
`samples.py`.

What runs the hooks is `RolloutLoopBase`, the base class: the process and its asyncio loop
(groups, in-flight accounting, stopping) in `worker.py`, when a group may start (staleness,
token allowance, server load, a fixed schedule) in `flow.py`, and a group's assembly, rewards,
samples and metrics records in `scoring.py`.
"""

from __future__ import annotations

import numpy as np

from reprorl.model.grpo_losses import group_advantages
from reprorl.serve.client import ServerRequestError

from .agents import assistant_message, call_tool, parse_tool_calls, tool_name
from .samples import Rollout, RolloutGroup, TurnRecord
from .worker import RolloutLoopBase


def prompt_token_ids(tokenizer, prompt: list[dict], chat_template_kwargs=None,
                     tools=None) -> list[int]:
    """A conversation as the token ids a turn sends (the generation prompt appended)."""
    text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True,
                                         tools=tools or None, **(chat_template_kwargs or {}))
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


class AsyncRolloutLoop(RolloutLoopBase):
    """The rollout worker's loop, with the hooks a subclass overrides (each has a default):

    - `filter_prompt(row_index, row, epoch)`: whether to generate for a prompt;
    - `generate_one(prompt, tools, group_id)`: one rollout (the default: the tool loop);
    - `generate_one_turn(prompt_ids)`: one sampling request, seeded by the rollout's place;
    - `compute_advantages(group)`: the scored group's advantages (GRPO's);
    - `setup()` / `close()`: create and release what the other hooks use.

    Hooks may read `self.config`, `self.dataset`, `self.tokenizer`, `self.tools`,
    `self.client` (the server's, open from `setup` on) and `self.tool_pool`, and call
    `record`, `record_rate`, `served_name` and `stopping` (`RolloutLoopBase`'s, like the
    constructor and everything that schedules, scores and queues).
    """

    # ------------------------------------------------------------ hooks

    def filter_prompt(self, row_index: int, row: dict, epoch: int) -> bool:
        """Whether to generate for this prompt; a rejected one counts as consumed."""
        return True

    async def generate_one(self, prompt: list[dict], tools: list, group_id: int = 0) -> Rollout:
        """One rollout: the tool loop. Each turn renders the whole conversation (with the
        tools' schemas), samples a reply, and runs the tool calls in it, in order, appending
        their results as tool messages; it ends at a turn without calls, a turn cut at
        max_completion_length, or after `max_tool_calling_iterations` tool-calling turns."""
        by_name = {tool_name(t): t for t in tools}
        limit = self.config.max_tool_calling_iterations
        rollout = Rollout([], [], [])
        while True:
            prompt_ids = prompt_token_ids(self.tokenizer, prompt + rollout.completion,
                                          self.config.chat_template_kwargs, tools)
            turn = await self.generate_one_turn(prompt_ids)
            rollout.turns.append(turn)
            rollout.completion_ids += turn.output_ids
            ids = turn.output_ids
            body = ids[:-1] if ids and ids[-1] in self.eos_token_ids else ids
            text = self.tokenizer.decode(body, skip_special_tokens=False)
            content, calls = parse_tool_calls(text) if tools else (text, [])
            if calls and turn.finish_reason != "stop":  # cut mid-reply: nothing is called
                content, calls = text, []
            rollout.completion.append(assistant_message(content, calls))
            if not calls:
                return rollout
            if limit is not None and len(rollout.tool_batches) >= limit:
                rollout.loop_exhausted = True
                return rollout
            rollout.tool_batches.append(len(calls))
            for call in calls:
                done = await call_tool(by_name, call["name"], call["arguments"],
                                       self.tool_pool, self.config.tool_timeout)
                rollout.tool_calls.append(done)
                if not done.unknown:
                    self.record("tools/latency_s", done.latency_s)
                    self.record(f"tools/{done.name}/latency_s", done.latency_s)
                rollout.tool_call_count += 1
                rollout.tool_failure_count += done.failed
                rollout.completion.append(
                    {"role": "tool", "name": done.name, "content": done.result})

    async def generate_one_turn(self, prompt_ids: list[int]) -> TurnRecord:
        """One sampling request with the config's settings and a fresh seed."""
        seed = self._next_seed()  # the rollout's n-th request, or the loop's outside one
        top = self.config.num_sampler_logprobs if self.config.score_centering else 0
        settings = {"prompt_ids": prompt_ids, "max_tokens": self.config.max_completion_length,
                    "temperature": self.config.temperature, "seed": seed, "logprobs": top}
        config = self.config
        settings["sampling"] = {"top_k": config.top_k, "top_p": config.top_p,
                                "min_p": config.min_p or 0.0,
                                "repetition_penalty": config.repetition_penalty}
        if self.config.truncated_sampling:  # the candidate sets too, when the server has them
            settings["sampling_mask"] = self.sampling_mask
        model = self._group_model()  # the adapter the group started under
        try:
            reply, retries = await self.client.complete(model=model, **settings)
        except ServerRequestError as error:
            # the group's adapter left the live window (max_staleness 0) before this request
            # got through: sample under the current one; the group keeps its older version,
            # so the trainer's staleness rule still judges it conservatively
            if error.status != 404 or self.lora_name is None or model == self.served_name() or (
                    self.config.schedule_lag is not None):  # a fixed schedule never swaps
                raise
            reply, retries = await self.client.complete(model=self.served_name(), **settings)
        self.record("rollout/vllm_retry_count", retries)  # 0s too: the metric is always there
        return TurnRecord(prompt_ids, reply.token_ids, reply.logprobs,
                          output_sampling_mask=reply.sampling_mask,
                          output_sampler_logprobs=reply.top_logprobs if top else None,
                          finish_reason=reply.finish_reason)

    def compute_advantages(self, group: RolloutGroup) -> np.ndarray:
        """GRPO: each reward standardised within the group; NaN rewards get 0."""
        return group_advantages(group.rewards)

    async def setup(self) -> None:
        """Create resources for the other hooks (runs on the loop before the first prompt)."""

    async def close(self) -> None:
        """Release what setup created (runs when the loop stops, also on failure)."""
