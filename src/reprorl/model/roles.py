"""The four model roles: actor, reference, reward, critic.

Each role owns its own backbone object, loaded from the base directory with
`from_pretrained(..., local_files_only=True)`, frozen, with its own LoRA adapters (rank 8,
alpha 16 on q/k/v/o/gate/up/down). The reward model and the critic add a scalar head of
hidden+1 parameters on the last hidden state: the reward head starts at normal(0, 0.02) with a
zero bias (seed 50), the critic's value head at zero. No parameter storage is shared between
roles: sharing a trainable backbone between critic and reward model would move the reward.

Scores are read through the response mask:
- `token_logprobs`: log pi(y_t | prefix) of every response token (EOS included);
- `values`: the critic's V on the prefix that produces each response token;
- `score`: the reward head at the last response token (EOS included), never at padding.
Roles stay in `eval()` mode throughout (no dropout); autograd is on wherever they learn.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from reprorl.core import devices
from reprorl.core.errors import ReproError
from reprorl.core.manifest import record_read

from . import lora
from .encoding import Batch, PairBatch, last_token_mask, mask_for

ROLES = ("actor", "reference", "reward", "critic")
LORA_RANK, LORA_ALPHA = 8, 16
ADAPTER_SEED = {"actor": 49, "reference": 49, "critic": 49, "reward": 50}
REWARD_HEAD_SEED, REWARD_HEAD_STD = 50, 0.02


def load_backbone(model_cfg: dict):
    """A fresh, frozen copy of the base model."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(
        model_cfg["path"],
        local_files_only=True,
        dtype=getattr(torch, model_cfg["dtype"]),
        attn_implementation=model_cfg["attn_implementation"],
        output_loading_info=True,
    )
    record_read(model_cfg["path"])
    missing = set(info.get("missing_keys", [])) - {"lm_head.weight"}
    if missing or info.get("unexpected_keys") or info.get("mismatched_keys"):
        raise ReproError(f"incomplete load of {model_cfg['path']}: {info}")
    return model.requires_grad_(False).eval()


class Role(nn.Module):
    def __init__(self, kind: str, backbone: nn.Module):
        super().__init__()
        if kind not in ROLES:
            raise ReproError(f"unknown role {kind!r}; roles are {ROLES}")
        self.kind = kind
        self.backbone = backbone
        self.adapter_parameters = lora.inject(backbone, LORA_RANK, LORA_ALPHA, ADAPTER_SEED[kind])
        self.head = None
        if kind in ("reward", "critic"):
            hidden = backbone.config.hidden_size
            # built on meta then filled, so making a head never draws from the global RNG
            self.head = nn.Linear(hidden, 1, device="meta").to_empty(device="cpu").float()
            with torch.no_grad():
                self.head.bias.zero_()
                if kind == "reward":
                    generator = torch.Generator().manual_seed(REWARD_HEAD_SEED)
                    self.head.weight.normal_(0.0, REWARD_HEAD_STD, generator=generator)
                else:
                    self.head.weight.zero_()
        if kind == "reference":
            self.requires_grad_(False)
        self.eval()

    # ------------------------------------------------------------ scores

    @property
    def device(self) -> torch.device:
        return devices.of(self)

    def _inputs(self, batch: Batch) -> dict:
        return {
            "input_ids": batch.input_ids,
            "attention_mask": batch.attention_mask,
            "position_ids": batch.position_ids,
            "use_cache": False,
        }

    @staticmethod
    def response_width(batch: Batch) -> int:
        return int(batch.response_mask.sum(1).max())

    def token_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, R) log-probs of the last R columns' tokens and their (B, R) response mask.

        Left padding puts every response in the last columns, so only the last R+1 positions
        need logits (R = longest response): with a 152k vocabulary that is most of the cost.
        """
        batch = batch.to(self.device)  # results and masks on the role's device
        width = self.response_width(batch)
        logits = self.backbone(**self._inputs(batch), logits_to_keep=width + 1).logits
        logits = logits[:, :-1].float()
        targets = batch.input_ids[:, -width:]
        logprobs = logits.log_softmax(-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return logprobs, batch.response_mask[:, -width:]

    def _head_on_last_hidden(self, batch: Batch) -> torch.Tensor:
        if self.head is None:
            raise ReproError(f"the {self.kind} role has no scalar head")
        hidden = self.backbone.model(**self._inputs(batch)).last_hidden_state  # after final norm
        return self.head(hidden.float()).squeeze(-1)

    def values(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(B, R) critic values V(prefix before each response token) and the response mask."""
        batch = batch.to(self.device)  # results and masks on the role's device
        width = self.response_width(batch)
        values = self._head_on_last_hidden(batch)[:, -width - 1 : -1]
        return values, batch.response_mask[:, -width:]

    def score_pairs(self, pairs: PairBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(P,) scores of the chosen and (P,) of the rejected responses of packed pairs, each
        read at its response's last token, as `score` reads them."""
        if self.kind != "reward":
            raise ReproError("only the reward role returns terminal scores")
        if self.head is None:
            raise ReproError(f"the {self.kind} role has no scalar head")
        pairs = pairs.to(self.device)
        hidden = self.backbone.model(input_ids=pairs.input_ids, position_ids=pairs.position_ids,
                                     attention_mask=mask_for(self.backbone, pairs.attention_mask),
                                     use_cache=False).last_hidden_state
        rows = torch.arange(len(pairs.last), device=hidden.device)
        ends = hidden[rows[:, None], pairs.last]  # (P, 2, H): chosen end, rejected end
        scores = self.head(ends.float()).squeeze(-1)
        return scores[:, 0], scores[:, 1]

    def score(self, batch: Batch) -> torch.Tensor:
        """(B,) reward head at each row's last response token, found through the mask."""
        if self.kind != "reward":
            raise ReproError("only the reward role returns terminal scores")
        batch = batch.to(self.device)
        mask = batch.response_mask
        if not bool(mask.any(1).all()) or bool((mask & ~batch.attention_mask.bool()).any()):
            raise ReproError("reward pooling needs a non-empty response on real tokens")
        values = self._head_on_last_hidden(batch)
        return values[last_token_mask(mask)]  # exactly one True per row


# ---------------------------------------------------------------- building and identities


def build(kind: str, model_cfg: dict, learned: dict[str, torch.Tensor] | None = None,
          adapters_only: bool = False) -> Role:
    """A role on its own freshly loaded backbone.

    `learned` replaces its adapters and head; with `adapters_only` just the adapters (the
    critic starts from the SFT adapters with its own zero value head).
    """
    # built on the CPU, so adapters and heads draw their initial values from CPU generators
    # (the seed's), then moved whole
    role = Role(kind, load_backbone(model_cfg)).to(devices.resolve(model_cfg["device"]))
    check_contract(role, getattr(torch, model_cfg["dtype"]))
    if learned is not None:
        load_learned(role, learned, heads=not adapters_only)
    return role


def check_contract(role: Role, dtype: torch.dtype) -> None:
    """The seed's parameter contract, on every role built: rank-8 adapters on the seven
    projections of every layer (r * (in + out) each: 4,399,104 for Qwen2.5-0.5B) and a head of
    hidden + 1 parameters (897 there), both FP32; every frozen base weight in `dtype`."""
    expected = lora.expected_parameter_count(role.backbone.config, LORA_RANK)
    head = sum(p.numel() for p in role.head.parameters()) if role.head is not None else 0
    problems = []
    if role.adapter_parameters != expected:
        problems.append(f"{role.adapter_parameters} adapter parameters, not {expected}")
    if role.head is not None and head != role.backbone.config.hidden_size + 1:
        problems.append(f"a head of {head} parameters, not hidden + 1")
    problems += [f"{n} is {t.dtype}, not float32" for n, t in learned_state(role).items()
                 if t.dtype != torch.float32]
    problems += [f"{n} is {t.dtype}, not {dtype}" for n, t in role.named_parameters()
                 if not is_learned(n) and t.dtype != dtype]
    if problems:
        raise ReproError(f"the {role.kind} role breaks the parameter contract: "
                         f"{'; '.join(problems[:3])}")


def is_learned(name: str) -> bool:
    return lora.is_adapter(name) or name.startswith("head.")


def learned_state(role: Role) -> dict[str, torch.Tensor]:
    return {n: p for n, p in role.named_parameters() if is_learned(n)}


def load_learned(role: Role, state: dict[str, torch.Tensor], heads: bool = True) -> None:
    """Copy learned tensors in; with heads=False only the adapters (SFT -> critic)."""
    target = {n: p for n, p in learned_state(role).items() if heads or lora.is_adapter(n)}
    source = {n: t for n, t in state.items() if heads or lora.is_adapter(n)}
    if set(target) != set(source):
        raise ReproError(f"learned tensors differ: {sorted(set(target) ^ set(source))[:4]}")
    with torch.no_grad():
        for name, parameter in target.items():
            if parameter.shape != source[name].shape or parameter.dtype != source[name].dtype:
                raise ReproError(f"{name}: {source[name].dtype} {list(source[name].shape)} "
                                 f"!= {parameter.dtype} {list(parameter.shape)}")
            parameter.copy_(source[name])


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}|{tensor.dtype}|{list(tensor.shape)}|".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def learned_identity(role: Role) -> str:
    return tensors_sha256(learned_state(role))


def frozen_identity(role: Role) -> str:
    return tensors_sha256({n: t for n, t in role.state_dict().items() if not is_learned(n)})


def isolation_report(roles: dict[str, Role]) -> dict:
    """Check the four roles share no storage and the frozen ones take no gradient."""
    if set(roles) != set(ROLES):
        raise ReproError(f"exactly the roles {ROLES} are needed, got {sorted(roles)}")
    storages = {
        name: {p.untyped_storage().data_ptr() for p in role.parameters()}
        for name, role in roles.items()
    }
    for a in ROLES:
        for b in ROLES:
            if a < b and storages[a] & storages[b]:
                raise ReproError(f"roles {a} and {b} share parameter storage")
    for name in ("reference", "reward"):
        if any(p.requires_grad or p.grad is not None for p in roles[name].parameters()):
            raise ReproError(f"the {name} role must be frozen and receive no gradient")
    return {
        name: {
            "parameters": sum(p.numel() for p in role.parameters()),
            "trainable": sum(p.numel() for p in role.parameters() if p.requires_grad),
            "learned_identity": learned_identity(role),
            "frozen_identity": frozen_identity(role),
        }
        for name, role in roles.items()
    }
