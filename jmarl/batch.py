"""`LearnerBatch`: what one learner's update reads, typed, from the plan's sample records to the loss.

The learner's layout packs real tokens only (`jmarl.train.packing`): each micro-batch's
distinct prompts and their continuations in R rows of L slots, the M predictions of
continuation tokens, and N samples of C continuation tokens for the loss (a leading policy
axis [P_pol, ...] when policies are stacked). Fields marked "filled" are None until the
trainer's scoring pass (old / reference log-probs, advantages) or the update itself
(`update_index`, the global counts) sets them:

    packed_tokens, packed_positions,
    packed_segment, packed_branch  int32[parts * R, L]  the packed rows (see jmarl.train.packing)
    pred_source, pred_target     int32[parts * M]  the slot that predicts, the token predicted
    pred_slot                    int32[N, C]    the prediction of each continuation token (-1: none)
    packed_routing               uint8/uint16[parts * R, L, S, k]  routing replay only (None
                                                otherwise): each packed slot's recorded experts
                                                in the S sparse layers (`moe.no_route`: none)
    tokens, attention_mask       int32 / bool[N, C]   continuations, right-padded
    loss_mask                    bool[N, C]     completion tokens trained on
    behavior_logprobs            f32[N, C]      log-probs under the policy that sampled them
    reward                       f32[N]         the plan's training reward
    group                        int32[N]       group id from 0; -1 = padding row
    agent                        int32[N]       index into env.agents
    learner                      int32[N]       policy id of the learner (the same on every row)
    source_policy                int32[N]       policy id that generated the sample
    source_seq_logprob           f32[N]         mean completion log-prob under the source
    old_logprobs, ref_logprobs   f32[N, C]      filled: the behaviour policy / the reference
    advantages                   f32[N]         filled: the method's advantages
    update_index                 int32[]        filled by the update: which optimizer update of the step
    num_tokens, num_rows         f32[]          filled by the update: trained tokens / rows of the
                                                whole mini-batch (the normalisers of the loss under
                                                gradient accumulation)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import struct

# the per-sample fields of a batch: name -> (one value per continuation token [N, C], else [N]; dtype)
SAMPLE_FIELDS: dict[str, tuple[bool, Any]] = {
    "tokens": (True, np.int32),
    "attention_mask": (True, np.bool_),
    "loss_mask": (True, np.bool_),
    "behavior_logprobs": (True, np.float32),
    "reward": (False, np.float32),
    "group": (False, np.int32),
    "agent": (False, np.int32),
    "learner": (False, np.int32),
    "source_policy": (False, np.int32),
    "source_seq_logprob": (False, np.float32),
}
# the fields of the packed layout: name -> dtype (packed_* [parts * R, L], pred_source/target [parts * M])
PACKED_FIELDS: dict[str, Any] = {
    "packed_tokens": np.int32, "packed_positions": np.int32, "packed_segment": np.int32, "packed_branch": np.int32,
}
PRED_FIELDS: dict[str, Any] = {"pred_source": np.int32, "pred_target": np.int32}
# what the model reads (the rest is for the loss); with routing replay also "packed_routing"
MODEL_INPUTS: tuple[str, ...] = (*PACKED_FIELDS, *PRED_FIELDS, "pred_slot")


@struct.dataclass
class LearnerBatch:
    """One learner's samples in the packed layout (see the module docstring for shapes)."""

    packed_tokens: jax.Array
    packed_positions: jax.Array
    packed_segment: jax.Array
    packed_branch: jax.Array
    pred_source: jax.Array
    pred_target: jax.Array
    pred_slot: jax.Array
    tokens: jax.Array
    attention_mask: jax.Array
    loss_mask: jax.Array
    packed_routing: jax.Array | None = None
    behavior_logprobs: jax.Array | None = None
    reward: jax.Array | None = None
    group: jax.Array | None = None
    agent: jax.Array | None = None
    learner: jax.Array | None = None
    source_policy: jax.Array | None = None
    source_seq_logprob: jax.Array | None = None
    old_logprobs: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
    advantages: jax.Array | None = None
    update_index: jax.Array | None = None
    num_tokens: jax.Array | None = None
    num_rows: jax.Array | None = None

    @property
    def num_samples(self) -> int:
        """N (the second-to-last axis of `pred_slot`)."""
        return int(self.pred_slot.shape[-2])

    def model_inputs(self) -> dict[str, jax.Array]:
        """The fields the model reads (`MODEL_INPUTS`, and `packed_routing` when it is set)."""
        inputs = {k: getattr(self, k) for k in MODEL_INPUTS}
        if self.packed_routing is not None:
            inputs["packed_routing"] = self.packed_routing
        return inputs

    @classmethod
    def loss_only(cls, **fields: Any) -> "LearnerBatch":
        """A batch for a method's advantages and loss on log-probs computed elsewhere: the given
        fields (tokens, attention_mask, loss_mask [N, C] and the rest), the model's inputs empty
        (N packed rows of one padding slot, N unused predictions, `pred_slot` all -1: they split
        into micro-batches as the samples do)."""
        n, c = np.shape(fields["loss_mask"])
        empty = {k: np.zeros((n, 1), dtype) for k, dtype in PACKED_FIELDS.items()}
        empty.update({k: np.zeros((n,), dtype) for k, dtype in PRED_FIELDS.items()})
        return cls(**empty, pred_slot=np.full((n, c), -1, np.int32), **fields)

    def is_cross(self) -> jax.Array:
        """bool[N]: samples generated by another policy than their learner (HACPO's cross samples)."""
        return self.source_policy != self.learner
