"""The learner: GRPO (and the tiny recipe's SFT warm start) on TrainBatches, one rank's share of each step.

Invariants:
- Old log-probs are computed once per batch (no grad, same packing, same kernels as the update
  pass), before any optimizer step, so every update epoch clips against the same policy. The
  first update from the generator's own weights sees ratio 1, ppo_kl 0, clipfrac 0 exactly.
  A step of one update epoch over one minibatch (the weights move once, after every micro-batch's
  backward) takes them from the update pass itself, detached (`old_logprobs_reused`): the same
  weights, packing and kernels, so the same numbers, without the extra forward pass (TRL does the
  same with num_iterations=1). A reference model's pass is never skipped.
- The old log-probs are the PROXIMAL policy of the decoupled objective; the sampler's per-token
  log-probs (the BEHAVIOUR policy) always reach the loss, which reports mismatch_kl every step and
  applies learner.correction's importance weight (policies/offpolicy.py) where it is on.
- Micro-batches are packed rows of whole samples under a token budget (policies/packing.py);
  nothing is padded to [B, max prompt + max response]. Attention never crosses samples.
- Multi-turn episodes: a sample's per-token loss mask (TrainGroup.loss_masks; none: all ones) leaves
  its observation tokens in the row as context and out of everything the loss computes: the
  policy-gradient, KL and entropy terms, the token-count normalisers, the TIS/MIS weights and the
  mismatch metrics. A mask of all ones is exactly the unmasked step. The SFT warm start takes the
  same masks.
- With learner.share_prompt, the consecutive samples of one group in a micro-batch form one part
  with the prompt computed once (policies/prefix.py): same log-probs, loss and update as the
  unshared row, fewer tokens. The plan's pairs decide the parts, so a planner that did not share
  (or split a group) stays exact; a group listed non-contiguously is refused naming the field.
- Every rank holds the whole TrainBatch and takes its share of each minibatch's micro-batches
  with policies/shard.py (token-balanced, the same number of forward/backward calls on every
  rank; a rank short of micro-batches runs an empty, zero-weight one, so ZeRO-3's gathers and the
  gradient all-reduce pair up). Old log-probs follow the same split.
- Gradient accumulation over a minibatch's micro-batches, across ranks, equals one big batch: each
  micro-batch loss is normalised by the WHOLE minibatch's valid tokens (or sequences), counted
  from the batch every rank holds, and scaled by the world size, because DeepSpeed averages
  gradients over the data-parallel world (ZeRO 0: allreduce_bucket's 1/dp; ZeRO 1/2: average_tensor;
  ZeRO 3: the reduce-scatter's 1/dp). The optimizer steps once per minibatch (the accumulation
  boundary is driven here, not by DeepSpeed's GAS).
- Every returned metric is a python float, reduced across ranks once per step: token-weighted
  means as (sum of weighted sums) / (sum of weights), maxima as max, totals counted from the batch.

`Learner` is a plain class (importable and testable without Ray); actors/learner/shell.py is the
thin Ray shell the coordinator talks to, actors/learner/group.py the group of ranks.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import structlog
import torch

from actors.learner.engine import LearnerEngine
from actors.learner.lora_base import LoraBase
from policies.grpo import policy_loss
from policies.packing import PackedBatch, pack, plan_micro_batches
from policies.prefix import group_runs, pack_shared
from policies.shard import split_across_ranks
from queues.messages import TrainBatch, unpack_floats, unpack_ids, unpack_loss_mask

log = structlog.get_logger("arctic_rl.learner")


class Learner(LoraBase, LearnerEngine):
    """DeepSpeed GRPO learner rank. See the module docstring for what it guarantees."""

    # ------------------------------------------------------------------ this rank's share

    def _materialise(self, batch: TrainBatch) -> list[dict[str, Any]]:
        """TrainBatch -> per micro-batch: the packed row and its per-position tensors, on the host
        (every rank checks the whole batch, so a malformed one fails on every rank alike)."""
        groups = batch.groups
        prompts = [torch.from_numpy(unpack_ids(g.prompt_tokens).astype("int64")) for g in groups]
        # The sampler's (behaviour) log-probs always reach the loss: mismatch_kl every step, and the
        # correction of learner.correction (policies/offpolicy.py) where it is on.
        use_gen = all(g.gen_logprobs for g in groups)
        seen: set[tuple[int, int]] = set()
        share = bool(self.cfg.share_prompt)
        out = []
        for m, plan in enumerate(batch.micro_batches):
            comps, adv, gen, masks = [], [], [], []
            for g, s in plan:
                if not (0 <= g < len(groups)) or not (0 <= s < len(groups[g].completions)):
                    raise ValueError(f"TrainBatch.micro_batches[{m}] names (group {g}, sample {s}), which does not exist")
                if (g, s) in seen:
                    raise ValueError(f"TrainBatch.micro_batches: (group {g}, sample {s}) appears twice")
                seen.add((g, s))
                grp = groups[g]
                comp = torch.from_numpy(unpack_ids(grp.completions[s]).astype("int64"))
                glp = torch.from_numpy(unpack_floats(grp.gen_logprobs[s]).copy()) if grp.gen_logprobs else None
                if glp is not None and len(glp) != len(comp):
                    raise ValueError(f"TrainBatch.groups[{g}].gen_logprobs[{s}] has {len(glp)} values for "
                                     f"{len(comp)} completion tokens")
                comps.append(comp)
                adv.append(float(grp.advantages[s]))
                gen.append(glp)
                masks.append(self._loss_mask(grp, g, s, len(comp)))
            if share:
                # Consecutive samples of one group -> one part with its prompt once (policies/prefix.py);
                # a multi-turn episode is its sample's branch, its observations masked out of the loss.
                runs = group_runs(plan, field=f"TrainBatch.micro_batches[{m}]")
                it, im = iter(comps), iter(masks)
                pb = pack_shared([(prompts[g], [next(it) for _ in ss], [next(im) for _ in ss]) for g, ss in runs],
                                 pad_to_multiple_of=self.pad_multiple)
            else:
                pb = pack([(prompts[g], c, lm) for (g, _), c, lm in zip(plan, comps, masks)],
                          pad_to_multiple_of=self.pad_multiple)
            out.append({"packed": pb, "advantages": pb.scatter_per_sample(adv),
                        "gen_logprobs": pb.scatter(gen) if use_gen else None, "weight": 1.0})
        for k, mbatch in enumerate(batch.minibatches):
            for i in mbatch:
                if not 0 <= i < len(out):
                    raise ValueError(f"TrainBatch.minibatches[{k}] names micro-batch {i}; there are {len(out)}")
        listed = sorted(i for mbatch in batch.minibatches for i in mbatch)
        if listed != list(range(len(out))):
            raise ValueError("TrainBatch.minibatches must list every micro-batch exactly once")
        return out

    @staticmethod
    def _loss_mask(grp, g: int, s: int, n: int) -> torch.Tensor | None:
        """Sample s's per-token loss mask (None: all ones; schema-2 groups have none), checked by name."""
        if not grp.loss_masks:
            return None
        if len(grp.loss_masks) != len(grp.completions):
            raise ValueError(f"TrainBatch.groups[{g}].loss_masks has {len(grp.loss_masks)} entries for "
                             f"{len(grp.completions)} samples")
        m = unpack_loss_mask(grp.loss_masks[s], n, field=f"TrainBatch.groups[{g}].loss_masks[{s}]")
        return None if m is None else torch.from_numpy(m)

    def _on_device(self, item: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device) if isinstance(v, (torch.Tensor, PackedBatch)) else v for k, v in item.items()}

    def _empty(self, use_gen: bool) -> dict[str, Any]:
        """A zero-weight micro-batch (one 2-token sample): it runs the forward and backward (ZeRO-3's
        gathers, the gradient hooks) and adds exactly nothing."""
        pb = pack([([0], [0])], pad_to_multiple_of=self.pad_multiple)
        zeros = torch.zeros(pb.input_ids.shape)
        return self._on_device({"packed": pb, "advantages": zeros, "gen_logprobs": zeros if use_gen else None,
                                "weight": 0.0})

    def _share(self, items: Sequence[dict[str, Any]], use_gen: bool) -> list[dict[str, Any]]:
        """This rank's micro-batches of one minibatch, on device, empty ones where it is short."""
        mine = split_across_ranks([it["packed"].num_tokens for it in items], self.world_size)[self.rank]
        return [self._on_device(items[i]) if i is not None else self._empty(use_gen) for i in mine]

    def _normalizer(self, items: Sequence[dict[str, Any]]) -> float:
        if self.cfg.loss_agg == "token-mean":
            return float(max(1, sum(it["packed"].num_loss_tokens for it in items)))
        return float(max(1, sum(it["packed"].num_samples for it in items)))

    def _reduce(self, values: dict[str, float], op: str = "sum") -> dict[str, float]:
        """Scalars summed ("sum") or maxed ("max") over ranks, in one collective."""
        if self.world_size == 1 or not values:
            return values
        import torch.distributed as dist

        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64,
                         device=self.device if self.device.type == "cuda" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return {k: float(v) for k, v in zip(keys, t.tolist())}

    # ------------------------------------------------------------------ training

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Old log-probs once, then update_epochs passes over the minibatches; one lr step."""
        if self.asleep:
            self.wake()
        t0 = time.perf_counter()
        items = self._materialise(batch)
        if not items:
            raise ValueError(f"TrainBatch for step {batch.step} has no micro-batches")
        c = self.cfg
        use_gen = any(it["gen_logprobs"] is not None for it in items)
        minibatches = [[items[i] for i in mb] for mb in batch.minibatches]
        norms = [self._normalizer(mb) for mb in minibatches]  # global: from the whole minibatch
        shares = [self._share(mb, use_gen) for mb in minibatches]
        reuse_old = self._reuses_old_logprobs(len(minibatches))
        with torch.no_grad():
            for it in (it for share in shares for it in share):
                if not reuse_old:
                    it["old_logprobs"], _ = self._forward(it["packed"])
                if self.ref_model is not None:
                    it["ref_logprobs"], _ = self._forward(it["packed"], module=self.ref_model)
        t_old = time.perf_counter() - t0

        # Additive per-rank quantities (summed over ranks once at the end) and maxima.
        tot: dict[str, float] = {"tokens_fwd": 0.0}
        mx: dict[str, float] = {"ratio_max": 0.0}
        # "auto" unresolved (a LearnerConfig built without config.validate): the legacy tis_cap switch.
        correction = None if c.correction == "auto" else c.correction
        if use_gen and (correction or ("tis" if c.tis_cap > 0 else "off")) != "off":
            mx["is_weight_max"] = 0.0
        grad_norms: list[float] = []
        scale = float(self.world_size)  # DeepSpeed averages gradients over the world
        for epoch in range(c.update_epochs):
            mx[f"epoch{epoch}/ratio_max"] = 0.0
            for share, norm in zip(shares, norms):
                for j, it in enumerate(share):
                    pb: PackedBatch = it["packed"]
                    weight = it["weight"]
                    self.engine.set_gradient_accumulation_boundary(j == len(share) - 1)
                    lp, ent = self._forward(pb, with_entropy=c.entropy_coef > 0)
                    if reuse_old:
                        it["old_logprobs"] = lp.detach()
                    loss, m = policy_loss(
                        lp, it["old_logprobs"], it["advantages"], pb.loss_mask, clip_low=c.clip_low,
                        clip_high=c.clip_high, agg=c.loss_agg, ref_logprobs=it.get("ref_logprobs"),
                        kl_coef=c.kl_coef, entropy=ent, entropy_coef=c.entropy_coef,
                        gen_logprobs=it["gen_logprobs"], tis_cap=c.tis_cap, seq_ids=pb.sample_index,
                        normalizer=norm, correction=correction, is_cap=c.correction_cap, objective=c.loss,
                        norm_tokens=float(c.loss_norm_tokens))
                    self.engine.backward(loss * (scale * weight))
                    w = m.pop("num_tokens") * weight
                    ratio_max = m.pop("ratio_max")
                    weight_max = m.pop("is_weight_max", 0.0)
                    m.pop("ratio_min", None)
                    # Micro-batch losses are shares of the minibatch loss (one normaliser): they add up,
                    # over micro-batches and over ranks.
                    m["pg_loss_sum"], m["loss_sum"] = m.pop("pg_loss") * weight, float(loss.detach()) * weight
                    if weight:
                        tot["tokens_fwd"] += pb.num_tokens
                        for key in ("ratio_max", f"epoch{epoch}/ratio_max"):
                            mx[key] = max(mx[key], ratio_max)
                        if "is_weight_max" in mx:
                            mx["is_weight_max"] = max(mx["is_weight_max"], weight_max)
                    for k, v in m.items():
                        for prefix in ("", f"epoch{epoch}/"):
                            if k.endswith("_sum"):
                                tot[prefix + k] = tot.get(prefix + k, 0.0) + v
                            else:
                                tot[prefix + "s:" + k] = tot.get(prefix + "s:" + k, 0.0) + v * w
                                tot[prefix + "w:" + k] = tot.get(prefix + "w:" + k, 0.0) + w
                grad_norms.append(self._optimizer_step())
        lr = float(self.scheduler.get_last_lr()[0])  # the rate this step used (read before stepping it)
        self.scheduler.step()
        self.step += 1
        elapsed = time.perf_counter() - t0
        tot, mx = self._reduce(tot, "sum"), self._reduce(mx, "max")
        metrics = self._step_metrics(tot, mx, len(batch.minibatches))
        metrics.update(
            grad_norm=float(sum(grad_norms) / len(grad_norms)),
            grad_norm_max=float(max(grad_norms)),
            lr=lr,
            optimizer_steps=float(len(grad_norms)),
            micro_batches=float(len(items)),
            num_loss_tokens=float(sum(it["packed"].num_loss_tokens for it in items)),
            # multi-turn episodes: observation tokens in the rows as context, kept out of the loss
            num_obs_tokens=float(sum(it["packed"].num_completion_tokens - it["packed"].num_loss_tokens for it in items)),
            num_tokens=float(sum(it["packed"].num_tokens for it in items)),
            old_logprob_s=float(t_old),
            old_logprobs_reused=float(reuse_old),
            step_s=float(elapsed),
            tokens_per_s=float(tot["tokens_fwd"] / max(elapsed - t_old, 1e-9)),
            # The figure that compares across packings (a shared prompt is fewer tokens for the same samples):
            # samples through forward+backward per second, over the same seconds as tokens_per_s.
            samples=float(sum(it["packed"].num_samples for it in items)),
            samples_per_s=float(sum(it["packed"].num_samples for it in items) * c.update_epochs
                                / max(elapsed - t_old, 1e-9)),
            step=float(self.step),
        )
        return metrics

    def _reuses_old_logprobs(self, num_minibatches: int) -> bool:
        """Whether this step's old log-probs are the update pass's own, detached (module docstring): one
        update epoch over one minibatch, so the weights move only after every micro-batch's backward."""
        return self.cfg.update_epochs == 1 and num_minibatches == 1

    def _step_metrics(self, tot: dict[str, float], mx: dict[str, float], num_minibatches: int) -> dict[str, float]:
        """The step's scalars from the rank-summed `tot` and rank-maxed `mx` of train_step."""
        epochs = self.cfg.update_epochs
        metrics = {k[2:]: tot[k] / tot["w:" + k[2:]] if tot["w:" + k[2:]] else 0.0
                   for k in tot if k.startswith("s:")}
        # pg_loss / loss: the mean over minibatches (each the sum of its micro-batch shares), then epochs.
        metrics["pg_loss"] = tot["pg_loss_sum"] / num_minibatches / epochs
        metrics["loss"] = tot["loss_sum"] / num_minibatches / epochs
        metrics["ratio_max"] = mx["ratio_max"]
        if "is_weight_max" in mx:
            metrics["is_weight_max"] = mx["is_weight_max"]
        if epochs > 1:
            for e in range(epochs):
                p = f"epoch{e}/"
                for k in ("ratio_mean", "ppo_kl", "clipfrac"):
                    if p + "s:" + k in tot:
                        w = tot[p + "w:" + k]
                        metrics[p + k] = tot[p + "s:" + k] / w if w else 0.0
                metrics[p + "ratio_max"] = mx[p + "ratio_max"]
                metrics[p + "pg_loss"] = tot[p + "pg_loss_sum"] / num_minibatches
        return metrics

    def sft_step(self, pairs: Sequence[tuple], lr: float | None = None) -> float:
        """One optimizer step of cross-entropy on the target tokens (temperature 1), this rank's share
        of the pairs' micro-batches, normalised by all of their trained target tokens. Returns the loss.

        `pairs`: (prompt, target) or (prompt, target, loss_mask) with one 0/1 per target token (a
        multi-turn warm start's observation tokens are 0: seen as context, never trained)."""
        if self.asleep:
            self.wake()
        if not pairs:
            raise ValueError("sft_step needs at least one (prompt, target) pair")
        plan = plan_micro_batches([len(p[0]) + len(p[1]) for p in pairs], self.micro_batch_tokens)
        packed = [{"packed": pack([pairs[i] for i in mb], pad_to_multiple_of=self.pad_multiple), "weight": 1.0}
                  for mb in plan]
        total = float(sum(it["packed"].num_loss_tokens for it in packed))
        share = self._share(packed, use_gen=False)
        if self.lora:  # the warm start builds the frozen base LoRA trains over (actors/learner/lora_base.py)
            return self._base_sft_step(share, total, lr)
        old_lrs = [g["lr"] for g in self.torch_optimizer.param_groups]
        if lr is not None:
            for g in self.torch_optimizer.param_groups:
                g["lr"] = lr
        loss_sum = 0.0
        try:
            for j, it in enumerate(share):
                pb = it["packed"]
                self.engine.set_gradient_accumulation_boundary(j == len(share) - 1)
                lp, _ = self._forward(pb, temperature=1.0)
                loss = -(lp * pb.loss_mask).sum() / max(total, 1.0)
                self.engine.backward(loss * (self.world_size * it["weight"]))
                loss_sum += float(loss.detach()) * it["weight"]
            self._optimizer_step()
        finally:
            for g, v in zip(self.torch_optimizer.param_groups, old_lrs):
                g["lr"] = v
        return float(self._reduce({"loss": loss_sum})["loss"])

    def sft_steps(self, chunks: Sequence[Sequence[tuple]], lr: float | None = None) -> dict[str, Any]:
        """`sft_step` on each chunk in order (one optimizer step per chunk): exactly as many separate calls
        would do, in one call (the warm start sends many steps per Ray call). Returns {"losses": one per
        chunk, "seconds": this rank's time inside the steps}."""
        t0 = time.perf_counter()
        losses = [self.sft_step(chunk, lr) for chunk in chunks]
        return {"losses": losses, "seconds": time.perf_counter() - t0}

    def logprobs(self, sequences: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[torch.Tensor]:
        """Per-completion-token log-probs under the current weights (temperature applied); this rank
        alone (a world of one, or ZeRO 0-2: no collective in a forward)."""
        with torch.no_grad():
            plan = plan_micro_batches([len(p) + len(c) for p, c in sequences], self.micro_batch_tokens)
            by_index: dict[int, torch.Tensor] = {}
            for mb in plan:
                pb = pack([sequences[i] for i in mb], pad_to_multiple_of=self.pad_multiple).to(self.device)
                lp, _ = self._forward(pb)
                for i, v in zip(mb, pb.unpack(lp)):
                    by_index[i] = v.cpu()
            out = [by_index[i] for i in range(len(sequences))]
        return out
