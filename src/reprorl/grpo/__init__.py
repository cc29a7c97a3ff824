"""Asynchronous GRPO, the trainer library: trainer, rollout worker, queue, batching and packing.

    from reprorl.grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(model="assets/model", reward_funcs=my_reward,
                               args=AsyncGRPOConfig(output_dir="out", embedded_server=True),
                               train_dataset=[{"prompt": [{"role": "user", "content": "..."}]}])
    trainer.train()
"""

from .config import AsyncGRPOConfig
from .rollout import AsyncRolloutLoop
from .samples import Rollout, RolloutGroup, TurnRecord
from .trainer import AsyncGRPOTrainer

__all__ = ["AsyncGRPOConfig", "AsyncGRPOTrainer", "AsyncRolloutLoop", "Rollout",
           "RolloutGroup", "TurnRecord"]
