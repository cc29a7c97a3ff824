"""Resume states: exact round trip, and one clear refusal for anything this project did not
write (no traceback, no torch advice to unpickle with weights_only=False)."""

import collections
import gzip
import io
import pickle

import pytest
import torch

from reprorl.core.errors import ReproError
from reprorl.core.state import first_difference, load_state, save_state


def _state() -> dict:
    return {"identity": {"seed": 49}, "learned": {"w": torch.arange(4.0)}, "updates": 3}


def _torch_bytes(value) -> bytes:
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def test_saved_state_loads_back_exactly_and_bytewise_stable(tmp_path):
    first, second = tmp_path / "a.pt.gz", tmp_path / "b.pt.gz"
    save_state(first, _state())
    save_state(second, _state())
    assert first.read_bytes() == second.read_bytes()  # no timestamp, no name in the header
    assert first_difference(load_state(first), _state()) is None


DAMAGED = {
    # a valid gzip of a pickle weights_only refuses: a class, an instance
    "class pickle": (gzip.compress(pickle.dumps(collections.OrderedDict)),
                     "not a weights-only torch file"),
    "instance pickle": (gzip.compress(pickle.dumps(collections.Counter("ab"), protocol=2)),
                        "is corrupted"),
    "gzip of garbage": (gzip.compress(bytes(range(256)) * 4), "is corrupted"),
    "gzip of text": (gzip.compress(b"hello"), "is corrupted (KeyError"),
    "empty gzip": (gzip.compress(b""), "is corrupted (EOFError"),
    "not gzip": (b"plain bytes", "not a complete gzip stream: Not a gzipped file"),
    "truncated gzip": (gzip.compress(_torch_bytes(_state()))[:-12], "not a complete gzip"),
    "empty file": (b"", "is corrupted"),
    "a list": (gzip.compress(_torch_bytes([1, 2])), "it holds a list, not a resume state"),
    "a tensor": (gzip.compress(_torch_bytes(torch.ones(2))), "it holds a Tensor, not a"),
    "a dict without identity": (gzip.compress(_torch_bytes({"learned": {}})),
                                "it holds a dict without an identity, not a resume state"),
}


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_state_is_one_clear_refusal(tmp_path, recwarn, case):
    data, message = DAMAGED[case]
    path = tmp_path / "sft-interrupt.pt.gz"
    path.write_bytes(data)
    with pytest.raises(ReproError) as caught:
        load_state(path)
    text = str(caught.value)
    assert message in text and "delete it and rerun the stage that writes it" in text
    assert "\n" not in text and "weights_only=False" not in text
    assert not [w for w in recwarn if "pickle protocol" in str(w.message)]
    assert path.read_bytes() == data  # the evidence is kept


def test_missing_state_names_the_stage_to_run(tmp_path):
    with pytest.raises(ReproError, match="is missing: run the stage that writes it first"):
        load_state(tmp_path / "nope.pt.gz")
