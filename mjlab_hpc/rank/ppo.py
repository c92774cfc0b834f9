"""rsl-rl's PPO with one collective per mini-batch instead of three.

rsl-rl's multi-GPU update does, per mini-batch: an all-reduce of the KL divergence, a broadcast
of the learning rate rank 0 derives from it, and an all-reduce of the gradients. Each costs a
round trip (~0.3-1.5 ms with gloo on a small VM, tens of microseconds with NCCL), and each is a
point where every rank waits for the slowest. `FoldedPPO` sends the KL divergence as one more
element of the gradient buffer and lets every rank derive the learning rate from that reduced
value; the all-reduce result is the same on every rank, so the learning rates agree without a
broadcast. The arithmetic is rsl-rl's, in rsl-rl's order (the learning rate goes through a
float32 tensor as its broadcast does), so training is bit-identical to the stock algorithm.

The gradients live in that buffer: each parameter's `.grad` is a view of it during the update,
so backward fills it and the sum over ranks needs no copy in or out.

Only the plain configuration is folded (no RND, no symmetry augmentation, parameters of one
dtype and device); anything else, and any single-process run, uses rsl-rl's own `update`.
"""

from __future__ import annotations

from itertools import chain

import torch
import torch.distributed as dist
from rsl_rl.algorithms import PPO
from torch import nn

__all__ = ["CLASS_NAME", "FoldedPPO", "fold_collectives"]


# What `resolve_callable` accepts for this class in an rsl-rl agent config.
CLASS_NAME = "mjlab_hpc.rank.ppo:FoldedPPO"


def fold_collectives(train_cfg: dict) -> dict:
    """`train_cfg` with rsl-rl's own PPO replaced by `FoldedPPO` (a copy; a custom algorithm
    class is left alone)."""
    from rsl_rl.utils import resolve_callable

    algorithm = train_cfg.get("algorithm", {})
    name = algorithm.get("class_name")
    if name is None or resolve_callable(name) is not PPO:
        return train_cfg
    return {**train_cfg, "algorithm": {**algorithm, "class_name": CLASS_NAME}}


class FoldedPPO(PPO):
    """PPO whose multi-rank update needs one all-reduce per mini-batch."""

    def update(self) -> dict[str, float]:
        """rsl-rl's update; folded when several ranks train the plain configuration."""
        if not self.is_multi_gpu or self.rnd or self.symmetry or not self._one_buffer_fits():
            return super().update()
        return self._folded_update()

    def _folded_update(self) -> dict[str, float]:
        if self.actor.is_recurrent or self.critic.is_recurrent:
            generator = self.storage.recurrent_mini_batch_generator(
                self.num_mini_batches, self.num_learning_epochs
            )
        else:
            generator = self.storage.mini_batch_generator(
                self.num_mini_batches, self.num_learning_epochs
            )
        adaptive = self.desired_kl is not None and self.schedule == "adaptive"
        mean_value_loss = mean_surrogate_loss = mean_entropy = 0.0
        buffer, params = self._gradient_buffer()
        for batch in generator:
            if self.normalize_advantage_per_mini_batch:
                with torch.no_grad():
                    batch.advantages = (batch.advantages - batch.advantages.mean()) / (
                        batch.advantages.std() + 1e-8
                    )
            self.actor(
                batch.observations,
                masks=batch.masks,
                hidden_state=batch.hidden_states[0],
                stochastic_output=True,
            )
            actions_log_prob = self.actor.get_output_log_prob(batch.actions)
            values = self.critic(
                batch.observations, masks=batch.masks, hidden_state=batch.hidden_states[1]
            )
            distribution_params = tuple(self.actor.output_distribution_params)
            entropy = self.actor.output_entropy

            kl_mean = None
            if adaptive:
                with torch.no_grad():
                    kl = self.actor.get_kl_divergence(
                        batch.old_distribution_params, distribution_params
                    )
                    kl_mean = torch.mean(kl)

            ratio = torch.exp(actions_log_prob - torch.squeeze(batch.old_actions_log_prob))
            surrogate = -torch.squeeze(batch.advantages) * ratio
            surrogate_clipped = -torch.squeeze(batch.advantages) * torch.clamp(
                ratio, 1.0 - self.clip_param, 1.0 + self.clip_param
            )
            surrogate_loss = torch.max(surrogate, surrogate_clipped).mean()
            if self.use_clipped_value_loss:
                value_clipped = batch.values + (values - batch.values).clamp(
                    -self.clip_param, self.clip_param
                )
                value_losses = (values - batch.returns).pow(2)
                value_losses_clipped = (value_clipped - batch.returns).pow(2)
                value_loss = torch.max(value_losses, value_losses_clipped).mean()
            else:
                value_loss = (batch.returns - values).pow(2).mean()
            loss = (
                surrogate_loss
                + self.value_loss_coef * value_loss
                - self.entropy_coef * entropy.mean()
            )

            buffer.zero_()  # the gradients (views of it) and the KL slot
            loss.backward()  # accumulates into the views, in place
            kl_mean = self._reduce_gradients(buffer, kl_mean)
            if kl_mean is not None:
                self._adapt_learning_rate(kl_mean)

            nn.utils.clip_grad_norm_(self.actor.parameters(), self.max_grad_norm)
            nn.utils.clip_grad_norm_(self.critic.parameters(), self.max_grad_norm)
            self.optimizer.step()

            mean_value_loss += value_loss.item()
            mean_surrogate_loss += surrogate_loss.item()
            mean_entropy += entropy.mean().item()

        for p in params:  # nothing outside the update sees the buffer
            p.grad = None
        num_updates = self.num_learning_epochs * self.num_mini_batches
        self.storage.clear()
        return {
            "value": mean_value_loss / num_updates,
            "surrogate": mean_surrogate_loss / num_updates,
            "entropy": mean_entropy / num_updates,
        }

    def _one_buffer_fits(self) -> bool:
        """Whether every trainable parameter's gradient fits one flat buffer (one dtype, one
        device)."""
        params = chain(self.actor.parameters(), self.critic.parameters())
        return len({(p.dtype, p.device) for p in params if p.requires_grad}) == 1

    def _gradient_buffer(self) -> tuple[torch.Tensor, list[nn.Parameter]]:
        """One flat buffer (every trainable parameter's gradient, then one element for the KL
        divergence) and the parameters whose `.grad` are now views of it, as DDP's
        `gradient_as_bucket_view`: backward accumulates into the views, the sum over ranks
        works on the buffer in place, and nothing is copied back. Zeroing the buffer instead
        of setting the gradients to None keeps rsl-rl's bits: a gradient that starts at +0
        only differs from a fresh one in the sign of a zero, which Adam and the gradient
        clipping cannot see. (A trainable parameter the loss never reaches gets a zero
        gradient instead of none; rsl-rl's models have none such, and its own multi-GPU
        update would misalign its buffer there.)"""
        # Once each (a parameter the actor and critic share has one gradient).
        params = [
            p
            for p in dict.fromkeys(chain(self.actor.parameters(), self.critic.parameters()))
            if p.requires_grad
        ]
        buffer = torch.zeros(
            sum(p.numel() for p in params) + 1, dtype=params[0].dtype, device=params[0].device
        )
        offset = 0
        for p in params:
            p.grad = buffer[offset : offset + p.numel()].view_as(p)
            offset += p.numel()
        return buffer, params

    def _reduce_gradients(
        self, buffer: torch.Tensor, kl_mean: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Average the gradients (views of `buffer`) and the KL divergence (its last element)
        over the ranks with one reduction; the averaged KL divergence."""
        if kl_mean is not None:
            buffer[-1] = kl_mean
        dist.all_reduce(buffer)
        buffer /= self.gpu_world_size
        return buffer[-1] if kl_mean is not None else None

    def _adapt_learning_rate(self, kl_mean: torch.Tensor) -> None:
        """rsl-rl's adaptive schedule, on every rank from the same averaged KL divergence."""
        if kl_mean > self.desired_kl * 2.0:
            self.learning_rate = max(1e-5, self.learning_rate / 1.5)
        elif kl_mean < self.desired_kl / 2.0 and kl_mean > 0.0:
            self.learning_rate = min(1e-2, self.learning_rate * 1.5)
        # rsl-rl broadcasts the rate as a float32 tensor: the same rounding keeps runs identical.
        self.learning_rate = torch.tensor(self.learning_rate, device=self.device).item()
        for group in self.optimizer.param_groups:
            group["lr"] = self.learning_rate
