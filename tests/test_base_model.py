"""Embedded base: tokenizer, pretraining, rebuild determinism, reload; local-model checks."""

import copy
import json
import os
from pathlib import Path

import pytest
import torch

from reprorl.core import config as configuration
from reprorl.core.errors import ReproError
from reprorl.core.manifest import files_under, sha256_file
from reprorl.model.encoding import chat_prompt
from reprorl.pipeline import base_model
from reprorl.pipeline.base_model import IM_END, IM_START, PAD, ModelDirectoryError

ROOT = Path(__file__).resolve().parents[1]


def ci_config(path: Path) -> dict:
    config = configuration.load(ROOT / "configs/ci.yaml")
    config["model"]["path"] = str(path)
    return config


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The CI-size embedded base, built twice from scratch."""
    directories = []
    for name in ("first", "second"):
        path = tmp_path_factory.mktemp(name) / "model"
        summary = base_model.build_embedded(ci_config(path), log=lambda m: None)
        directories.append(path)
    return directories, summary


def test_rebuild_gives_identical_files(built):
    (first, second), _ = built
    hashes = [{p.name: sha256_file(p) for p in files_under(d)} for d in (first, second)]
    assert hashes[0] == hashes[1]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(hashes[0])


def test_pretraining_lowers_the_loss(built):
    _, summary = built
    curve = summary["learning_curve"]
    assert len(curve) == 20 and curve[-1] < 0.75 * curve[0]


def test_reload_from_pretrained_local_only(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    (first, _), _ = built
    tokenizer = AutoTokenizer.from_pretrained(first, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(first, local_files_only=True)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # Qwen's layout: specials after the learned ids, pad < im_start < im_end
    vocab = len(tokenizer)
    ids = [tokenizer.convert_tokens_to_ids(t) for t in (PAD, IM_START, IM_END)]
    assert ids == [vocab - 3, vocab - 2, vocab - 1]
    assert tokenizer.eos_token == IM_END and tokenizer.pad_token == PAD
    assert model.config.eos_token_id == ids[2] and model.config.pad_token_id == ids[0]
    text = chat_prompt(tokenizer, "Ticket X. Printer is silent.")
    assert text == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                    "<|im_start|>user\nTicket X. Printer is silent.<|im_end|>\n"
                    "<|im_start|>assistant\n")
    encoded = tokenizer(text + "Next step: re-enable Wi-Fi." + IM_END, add_special_tokens=False)
    assert encoded["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(encoded["input_ids"]) == text + "Next step: re-enable Wi-Fi." + IM_END
    with torch.no_grad():
        logits = model(torch.tensor([encoded["input_ids"]])).logits
    assert logits.shape[-1] == model.config.vocab_size and torch.isfinite(logits).all()


def test_embedded_directory_verifies(built):
    (first, _), _ = built
    found = base_model.verify(ci_config(first))
    assert found["architecture"]["num_hidden_layers"] == 2 and found["dtype"] == "float32"


def qwen_config(path: Path) -> dict:
    config = configuration.load(ROOT / "configs/qwen2.5-0.5b.yaml")
    config["model"]["path"] = str(path)
    return config


def test_missing_local_model_says_where_weights_go(tmp_path):
    with pytest.raises(ModelDirectoryError) as error:
        base_model.verify(qwen_config(tmp_path / "absent"))
    message = str(error.value)
    assert "absent" in message and "7ae557604adf67be50417f59c2c2f167def9a775" in message


def test_wrong_architecture_is_named(built):
    (first, _), _ = built
    with pytest.raises(ModelDirectoryError, match="hidden_size=64, the profile expects 896"):
        base_model.verify(qwen_config(first))


def _qwen_like_tokenizer(directory: Path) -> None:
    """A byte-level tokenizer with Qwen2.5's vocabulary size and special-token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: i for i, token in enumerate(alphabet)}
    vocab.update({f"filler{i}": i for i in range(len(alphabet), 151643)})
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([PAD, IM_START, IM_END])
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token=IM_END, pad_token=PAD,
                            chat_template=base_model.CHAT_TEMPLATE).save_pretrained(directory)


@pytest.fixture(scope="module")
def qwen_shaped(tmp_path_factory):
    """A directory with Qwen2.5-0.5B-Instruct's exact architecture (zero BF16 weights)."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    directory = tmp_path_factory.mktemp("qwen")
    expect = configuration.load(ROOT / "configs/qwen2.5-0.5b.yaml")["model"]["expect"]
    keys = {k: v for k, v in expect.items() if not k.startswith(("eos", "pad", "model_type"))}
    config = Qwen2Config(**keys, bos_token_id=151643, eos_token_id=151645, dtype="bfloat16")
    config.save_pretrained(directory)
    with torch.device("meta"):
        shapes = {n: t.shape for n, t in Qwen2ForCausalLM(config).state_dict().items()}
    shapes.pop("lm_head.weight")  # tied to the embedding, not stored
    save_file({n: torch.zeros(s, dtype=torch.bfloat16) for n, s in shapes.items()},
              str(directory / "model.safetensors"))
    _qwen_like_tokenizer(directory)
    record_download(directory, REVISION)
    return directory


REVISION = "7ae557604adf67be50417f59c2c2f167def9a775"  # the profile's pin


def record_download(directory: Path, commit: str) -> None:
    """The record `huggingface-cli download --revision --local-dir` leaves, written by
    huggingface_hub's own writer: the Hub's etag is sha256 for LFS files (the weights, the
    tokenizer) and git's blob sha1 for the small files kept in git."""
    import hashlib

    from huggingface_hub._local_folder import write_download_metadata
    from huggingface_hub.utils.sha import git_hash

    for file in files_under(directory):
        if ".cache" in file.relative_to(directory).parts:
            continue
        data = file.read_bytes()
        lfs = file.suffix == ".safetensors" or file.name == "tokenizer.json"
        etag = hashlib.sha256(data).hexdigest() if lfs else git_hash(data)
        write_download_metadata(directory, file.relative_to(directory).as_posix(), commit, etag)


def test_qwen_shaped_directory_passes_and_counts_parameters(qwen_shaped):
    found = base_model.verify(qwen_config(qwen_shaped))
    assert found["parameters"] == 494_032_768  # Qwen2.5-0.5B, tied embeddings counted once
    assert (found["eos_token_id"], found["pad_token_id"]) == (151645, 151643)
    assert found["revision"] == {"commit": REVISION, "files_checked": len(found["files"])}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(found["files"])
    assert not any(".cache" in name for name in found["files"])


def test_pinned_revision_is_checked_file_by_file(qwen_shaped, tmp_path):
    """Each way a directory can stop being the pinned commit is refused, naming the file."""
    import shutil

    def copy(name: str) -> Path:
        """The fixture's files hard-linked (1 GB of weights, not copied) and its record
        copied; a file a case changes is replaced, never written through the link."""
        directory = tmp_path / name
        shutil.copytree(qwen_shaped, directory, ignore=shutil.ignore_patterns(".cache"),
                        copy_function=os.link)
        shutil.copytree(qwen_shaped / ".cache", directory / ".cache")
        return directory

    def replace(file: Path, data: bytes) -> None:
        file.unlink()
        file.write_bytes(data)

    def refused(directory: Path, match: str, revision: str = REVISION) -> None:
        config = qwen_config(directory)
        config["model"]["revision"] = revision
        with pytest.raises(ModelDirectoryError, match=match):
            base_model.verify(config)

    no_record = copy("no-record")
    shutil.rmtree(no_record / ".cache")
    refused(no_record, "has no download record, so nothing shows it is revision 7ae5576")
    other_commit = copy("other-commit")
    record_download(other_commit, "0" * 40)
    refused(other_commit, f"was downloaded at commit {'0' * 40}, the profile pins {REVISION}")
    edited = copy("edited")  # same length, one byte changed: only the hash can tell
    text = (edited / "tokenizer_config.json").read_text()
    replace(edited / "tokenizer_config.json", text.replace('"', "'", 1).encode())
    refused(edited, "tokenizer_config.json is not the file of revision .*: its content hash")
    weights = copy("weights")  # LFS file: sha256 etag
    data = bytearray((weights / "model.safetensors").read_bytes())
    data[-1] ^= 1
    replace(weights / "model.safetensors", bytes(data))
    refused(weights, "model.safetensors is not the file of revision")
    extra = copy("extra")
    (extra / "notes.txt").write_text("added by hand")
    refused(extra, "notes.txt is not in the download record")
    (extra / "model-00002.safetensors").write_bytes(b"")
    refused(extra, "model-00002.safetensors is not a readable safetensors file")
    partial = copy("partial")
    (partial / "tokenizer.json").unlink()
    refused(partial, "tokenizer.json was downloaded but is missing")
    refused(copy("branch"), "only a full 40-hex commit can be checked", revision="main")
    config = qwen_config(no_record)
    config["model"]["revision"] = None  # the documented way out
    assert "revision" not in base_model.verify(config)


def test_qwen_profile_rejects_wrong_dtype_and_shapes(qwen_shaped, tmp_path):
    config = copy.deepcopy(qwen_config(qwen_shaped))
    config["model"]["dtype"] = "float32"
    with pytest.raises(ModelDirectoryError, match=r"dtypes \['BF16'\].*only F32"):
        base_model.verify(config)
    # same config.json, weights of another width: caught from the headers alone
    from safetensors.torch import save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (broken / name).write_bytes((qwen_shaped / name).read_bytes())
    save_file({"model.embed_tokens.weight": torch.zeros(151936, 64, dtype=torch.bfloat16)},
              str(broken / "model.safetensors"))
    record_download(broken, REVISION)  # a true record of wrong weights: the shapes catch it
    with pytest.raises(ModelDirectoryError, match="model.embed_tokens.weight is \\[151936, 64\\]"):
        base_model.verify(qwen_config(broken))


def test_tokenizer_ids_checked_against_profile(qwen_shaped):
    config = copy.deepcopy(qwen_config(qwen_shaped))
    config["model"]["expect"]["eos_token_id"] = 7
    with pytest.raises(ModelDirectoryError, match="eos_token_id=151645, expected 7"):
        base_model.verify(config)
    assert json.loads((qwen_shaped / "config.json").read_text())["vocab_size"] == 151936


def test_qwen_roles_keep_the_seed_parameter_contract(qwen_shaped):
    """At the real dimensions: 4,399,104 FP32 adapter parameters per role, an FP32 head of 897
    on the reward model, BF16 base weights, the seed's eager attention; a role on a base of
    the wrong dtype is refused when it is built."""
    from reprorl.model import roles

    config = qwen_config(qwen_shaped)
    reward = roles.build("reward", config["model"])
    assert reward.adapter_parameters == 4_399_104
    assert sum(p.numel() for p in reward.head.parameters()) == 897
    assert reward.backbone.config._attn_implementation == "eager"
    assert {p.dtype for n, p in reward.named_parameters() if not roles.is_learned(n)} == {
        torch.bfloat16}
    del reward
    reward = roles.Role("reward", roles.load_backbone(config["model"]))
    with pytest.raises(ReproError, match="parameter contract: .* is torch.bfloat16, not "
                                         "torch.float32"):
        roles.check_contract(reward, torch.float32)
