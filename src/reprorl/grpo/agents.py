"""Tools and environments for agent rollouts (the seed's "Agent training").

A tool is a module-level Python function (sync or async), called by its `__name__`; its JSON
schema comes from its type hints and Google-style docstring (transformers' `get_json_schema`,
the schema `apply_chat_template(tools=...)` renders). An environment is a class (or any
factory) with `reset(**row)`, an optional `get_reward()`, and public methods that are its
tools. The rollout worker (`worker.py`) keeps one instance per rollout in flight, reused across
episodes (`EnvironmentPool`), and runs the tool loop turn by turn.

A tool call is written as Qwen2.5 writes it, and as the embedded model's template renders it:
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` after the turn's text. A turn
whose blocks do not all parse as such JSON is plain text: it calls nothing (as in TRL). A call
that raises, names no tool, or outruns `tool_timeout` fails: its result is
`{"error": "..."}` and the rollout goes on; the model sees the error. Sync tools run in a
thread pool; docs/grpo.md lists where this departs from TRL's worker.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import inspect
import json
import time
from dataclasses import dataclass
from typing import Any

from reprorl.model.tool_calls import parse_tool_calls  # noqa: F401 (the worker's parser)

RESERVED = ("reset", "get_reward")  # an environment's lifecycle, never a tool


@dataclass
class ToolCall:
    """One call the model made, and what came of it."""

    name: str
    arguments: dict
    result: str  # the tool message's content
    failed: bool = False
    unknown: bool = False  # the name is no tool of this rollout (a policy error)
    latency_s: float = 0.0
    timed_out: bool = False  # its thread may still run: its environment is not reused


def tool_name(func) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


def tool_schema(func, owner: str = "tool") -> dict:
    """The JSON schema the chat template renders; a clear error when it cannot be made."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(func)
    except Exception as error:
        raise ValueError(
            f"{owner} {tool_name(func)!r} has no usable schema ({error}): give every argument "
            "a type hint and write a Google-style docstring with a summary line and an "
            "'Args:' entry per argument") from error


def check_tools(tools) -> list:
    """`tools` as a list of module-level callables with schemas, each name once."""
    tools = list(tools or [])
    seen = set()
    for func in tools:
        if not callable(func):
            raise TypeError(f"tools: {func!r} is not callable; pass Python functions")
        name = tool_name(func)
        qualname = getattr(func, "__qualname__", "")
        if name == "<lambda>" or "<locals>" in qualname:
            raise TypeError(f"tool {qualname or name!r} is a lambda or a closure: the rollout "
                            "worker is another process and calls tools by name, so define it "
                            "at module level")
        if name in seen:
            raise ValueError(f"two tools are named {name!r}: the model calls them by name")
        seen.add(name)
        tool_schema(func)
    return tools


def environment_factories(environment_factory) -> dict[str | None, Any]:
    """One factory (key None: every row) or a dict name -> factory (rows pick by their
    `environment` column)."""
    if environment_factory is None:
        return {}
    factories = (dict(environment_factory) if isinstance(environment_factory, dict)
                 else {None: environment_factory})
    for name, factory in factories.items():
        if not callable(factory):
            raise TypeError(f"environment_factory{'' if name is None else f'[{name!r}]'} is "
                            "not callable: pass a class (or a function) that makes an "
                            "environment")
    return factories


def environment_tools(environment) -> list:
    """The public methods of an environment instance, bound: its tools."""
    return [method for name, method in inspect.getmembers(environment, inspect.ismethod)
            if not name.startswith("_") and name not in RESERVED]


def probe_environments(factories: dict, tools: list = ()) -> dict[str | None, bool]:
    """Make one instance of each environment to check it (it has a reset(), its tools have
    schemas and names no standalone tool has); returns, per environment, whether it owns a
    reward (`get_reward`)."""
    owns_reward, standalone = {}, {tool_name(f) for f in tools}
    for key, factory in factories.items():
        label = "environment" if key is None else f"environment {key!r}"
        instance = factory()
        if not callable(getattr(instance, "reset", None)):
            raise TypeError(f"{label} ({type(instance).__name__}) has no reset() method: it is "
                            "called with the row's columns at the start of every rollout")
        for method in environment_tools(instance):
            tool_schema(method, f"{label} method")
            if method.__name__ in standalone:  # TRL lets the method win without a word
                raise ValueError(f"{label} method {method.__name__!r} has the name of a tool "
                                 "in tools: the model calls tools by name and could not "
                                 "reach both; rename one of them")
        owns_reward[key] = callable(getattr(instance, "get_reward", None))
    return owns_reward


def assistant_message(content: str, calls: list[dict]) -> dict:
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [{"type": "function", "function": dict(call)} for call in calls]
    return message


def result_text(value) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return str(value)


async def run_in_pool(func, pool, timeout: float, kwargs: dict):
    """Await `func(**kwargs)`: a coroutine function (or an instance whose __call__ is one) on
    the loop, anything else in the thread pool (with the caller's context), either within
    `timeout` seconds; tools, environments and reward functions all run through here. (The
    arguments come as one dict: a tool may name its own `timeout`.)"""
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(
            getattr(type(func), "__call__", None)):
        return await asyncio.wait_for(func(**kwargs), timeout)
    call = functools.partial(contextvars.copy_context().run, func, **kwargs)
    return await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(pool, call),
                                  timeout)


async def call_tool(tools: dict, name: str, arguments: dict, pool, timeout: float) -> ToolCall:
    """Run one call; whatever goes wrong becomes the model's `{"error": ...}` message.

    A sync tool that times out keeps its pool thread until it returns (Python cannot stop a
    thread); the rollout goes on without it.
    """
    func = tools.get(name)
    if func is None:
        message = f"no tool named {name!r}; the tools are {sorted(tools)}"
        return ToolCall(name, arguments, json.dumps({"error": message}), True, True)
    started = time.monotonic()
    try:
        value = await run_in_pool(func, pool, timeout, arguments)
        return ToolCall(name, arguments, result_text(value), latency_s=time.monotonic() - started)
    except TimeoutError:
        return ToolCall(name, arguments, json.dumps(
            {"error": f"{name} timed out after {timeout:g} s"}), True,
            latency_s=time.monotonic() - started, timed_out=True)
    except Exception as exception:  # noqa: BLE001 (the policy sees it, the run goes on)
        error = f"{type(exception).__name__}: {exception}"
    return ToolCall(name, arguments, json.dumps({"error": error}), True,
                    latency_s=time.monotonic() - started)


class EnvironmentPool:
    """Idle environment instances per name: a rollout takes one (or a new one) and gives it
    back when scored, so there are as many as rollouts were ever in flight at once."""

    def __init__(self, factories: dict):
        self.factories = factories
        self.idle: dict = {key: [] for key in factories}

    def key_of(self, row: dict):
        if None in self.factories:
            return None
        key = row.get("environment")
        if key not in self.factories:
            raise ValueError(f"row has environment={key!r}; environment_factory names "
                             f"{sorted(self.factories)}: give every row one of them")
        return key

    def take(self, key):
        return self.idle[key].pop() if self.idle[key] else self.factories[key]()

    def give_back(self, key, instance) -> None:
        self.idle[key].append(instance)


def observe(prompt: list[dict] | None, observation) -> list[dict]:
    """The prompt a rollout starts from: the row's (or one empty user message), with the
    string `reset()` returned appended to its last message."""
    messages = [dict(m) for m in (prompt or [{"role": "user", "content": ""}])]
    if observation is not None:
        messages[-1]["content"] = messages[-1]["content"] + str(observation)
    return messages


def check_prefix_preserving(tokenizer, chat_template_kwargs=None) -> None:
    """The tool loop re-renders the conversation each turn: appending a tool message must not
    change how earlier messages render, and the template must render tools at all."""
    def probe(step: int) -> int:
        """Probe tool.

        Args:
            step: A number.
        """
        return step

    call = assistant_message("", [{"name": "probe", "arguments": {"step": 1}}])
    head = [{"role": "user", "content": "u"}, call]
    kwargs = dict(tokenize=False, tools=[probe], **(chat_template_kwargs or {}))
    before = tokenizer.apply_chat_template(head, **kwargs)
    after = tokenizer.apply_chat_template(
        head + [{"role": "tool", "name": "probe", "content": "R"}],
        add_generation_prompt=True, **kwargs)
    if "Probe tool." not in before or '"step"' not in before:
        raise ValueError("the tokenizer's chat template does not render tools, so the model "
                         "would never see them: pass a processing_class whose template does "
                         "(Qwen2.5's, or the embedded base's of this release: rebuild it)")
    if not after.startswith(before) or "R" not in after[len(before):]:
        raise ValueError("the tokenizer's chat template is not prefix-preserving with tools "
                         "(adding a tool message re-renders earlier messages, or tool messages "
                         "are not rendered): pass a processing_class whose template is")
