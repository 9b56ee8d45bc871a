"""A rollout worker of its own (asynchronous training, `actor_rollout_ref.hybrid_engine=false`):
one process per rank of the rollout pool holds a vLLM engine and nothing of the trainer's. It
generates while the trainer's workers update, and takes new weights from the trainer's rank 0
over a `WeightChannel`."""

from __future__ import annotations

import time

from hybrid_rl.controller import Dispatch, register
from hybrid_rl.models import load_tokenizer
from hybrid_rl.protocol import Batch
from hybrid_rl.rollout_trace import rollout_tracer
from hybrid_rl.workers.actor_rollout_ref import eos_ids
from hybrid_rl.workers.base import ModelWorker
from hybrid_rl.workers.rollout import VLLMRollout, generate_batch, tool_loop, verl_agent_loops
from hybrid_rl.workers.weight_sync import WeightChannel


class RolloutWorker(ModelWorker):
    role = "rollout"

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def init_model(self) -> dict:
        self.device = self.setup_device()
        tok = load_tokenizer(self.cfg, self.model_path)
        self.pad_token_id = tok.pad_token_id
        self.eos_token_ids = eos_ids(self.model_path, tok)
        # Random weights until the trainer's first push.
        self.rollout = VLLMRollout(self.model_path, self.cfg.actor_rollout_ref.rollout, self.device,
                                   self.eos_token_ids, self.cfg.actor_rollout_ref.model)
        self.multi_turn = tool_loop(self.cfg, tok, self.eos_token_ids)
        self.agent_loops = verl_agent_loops(self.cfg, tok)
        self.tracer = rollout_tracer(self.cfg, tok, self.rollout)
        return self.rollout.settings()

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def join_weight_channel(self, host: str, port: int, world_size: int) -> None:
        """Rank r of this pool is rank r + 1 of the channel (the trainer's rank 0 is its rank 0)."""
        self.channel = WeightChannel(host, port, self.rank + 1, world_size, self.device,
                                     timeout_s=self.cfg.actor_rollout_ref.nccl_timeout)

    @register(dispatch=Dispatch.ONE_TO_ALL)
    def receive_weights(self) -> float:
        """Load the weights the trainer pushes now; returns the seconds it took here."""
        start = time.perf_counter()
        self.rollout.load_weights(self.channel.receive())
        return time.perf_counter() - start

    @register(dispatch=Dispatch.DP_COMPUTE, mesh="rollout")
    def generate_sequences(self, prompts: Batch) -> Batch:
        """As `ActorRolloutRefWorker.generate_sequences`, with the weights of the last push."""
        return generate_batch(self.rollout, self.multi_turn, self.cfg, prompts, self.pad_token_id, self.eos_token_ids,
                              self.tracer, self.agent_loops)
