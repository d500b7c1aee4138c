"""One calling convention for every policy loss, and the metadata a trainer reads instead of signatures.

A loss is written once, as a *kernel*: a function of the prepared ``TokenBatch`` and the loss's own
hyper-parameters (keyword-only, with defaults) that returns the per-token loss [B, T] and its metrics (per-token
[B, T] arrays are averaged over valid tokens, scalars pass through). ``policy_loss(...)`` turns a kernel into a
``PolicyLoss``, which is

* called like a plain function, e.g. ``ppo_loss(logits, tokens, old_logprobs, advantages, mask, clip_high=0.28)``
  (positional or keyword, as documented in docs/losses.md; ``inspect.signature`` shows the full signature);
* or called with the arguments every policy loss shares gathered in one ``PolicyInputs``:
  ``ppo_loss.apply(logits, PolicyInputs(tokens, old_logprobs, advantages, mask), clip_high=0.28)``;
* described by metadata: ``anchor`` (the name of the log-probs the ratio is taken against: ``old_logprobs``,
  ``behaviour_logprobs``, ``proximal_logprobs``, or None), ``extras`` (further per-token [B, T] arrays it needs,
  keyword-only), ``default_aggregation``, ``option_defaults``, ``required_arrays(**options)`` and
  ``needs_trainer_logprobs`` (whether it reads old / proximal log-probs, which a trainer must recompute when
  its rollouts come from a different engine or older weights).

A trainer therefore never inspects a signature: it reads ``anchor`` / ``required_arrays`` to know which arrays
to supply and ``default_aggregation`` for the denominator, then calls ``apply``.
"""
from __future__ import annotations

import dataclasses
import inspect
from types import MappingProxyType
from typing import Any, Callable, Mapping

import jax

from jodc.losses._checks import check_logits
from jodc.losses._policy import TokenBatch, finish, prepare

Kernel = Callable[..., tuple[jax.Array, Mapping[str, jax.Array]]]


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
    """The arguments every policy loss shares (besides the logits).

    ``anchor_logprobs`` [B, T] are the log-probs the loss's ratio is taken against (the loss's ``anchor``; None
    for losses without one, e.g. DG). ``aggregation=None`` means the loss's own default. The remaining fields
    are documented in ``jodc.losses.aggregation.aggregate`` (normalizer, segment_ids, norm_length) and
    ``token_logprobs`` (temperature, chunk_size). A pytree: the arrays are leaves, the options static."""

    tokens: Any
    anchor_logprobs: Any
    advantages: Any
    mask: Any
    aggregation: str | None = None
    normalizer: Any = None
    segment_ids: Any = None
    norm_length: int | None = None
    temperature: float = 1.0
    chunk_size: int | None = None


jax.tree_util.register_dataclass(
    PolicyInputs,
    data_fields=["tokens", "anchor_logprobs", "advantages", "mask", "normalizer", "segment_ids"],
    meta_fields=["aggregation", "norm_length", "temperature", "chunk_size"],
)

#: Keyword arguments every policy loss accepts (the options of ``PolicyInputs``).
SHARED_KEYWORDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(PolicyInputs))[4:]
_POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD
_KEYWORD = inspect.Parameter.KEYWORD_ONLY


@dataclasses.dataclass(frozen=True, eq=False)
class PolicyLoss:
    """A policy loss: its kernel plus what a caller needs to know to feed it (see the module docstring).

    Attributes:
      name: the public function name (``ppo_loss``); presets append their options (``ppo_loss[clip_high=0.28]``).
      kernel: ``kernel(batch: TokenBatch, **options) -> (per_token_loss, metrics)``.
      anchor: argument name of the log-probs the ratio is taken against, None when the loss needs none.
      default_aggregation: the aggregation used when the caller gives none.
      extras: required keyword-only per-token [B, T] arrays besides the anchor (e.g. ``behaviour_logprobs``).
      advantages: whether the loss takes advantages (False only for the KL penalty).
      anchor_slot: accept and ignore a positional anchor although the loss has none (the registry's uniform
        ``(logits, tokens, anchor_logprobs, advantages, mask)`` convention for DG).
      presets: option values that replace the kernel's defaults (registry aliases such as ``dapo``).
      gather: ``gather(fn, bt, options) -> ids [B, T, K] | None``: extra ids to take log pi at in the same pass
        over the vocabulary (DPPO Top-K); it also checks the arrays it returns.
      needs: ``needs(options) -> tuple of names``: option-dependent per-token arrays the caller must supply
        (DPPO Top-K's ``topk_ids`` / ``topk_logprobs``).
    """

    name: str
    kernel: Kernel
    anchor: str | None
    default_aggregation: str = "token-mean"
    extras: tuple[str, ...] = ()
    advantages: bool = True
    anchor_slot: bool = False
    presets: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    gather: Callable[[str, tuple, Mapping], Any] | None = None
    needs: Callable[[Mapping], tuple[str, ...]] | None = None

    def __post_init__(self):
        options = self._kernel_options()
        unknown = set(self.presets) - set(options)
        if unknown:
            raise TypeError(f"{self.name}: presets {sorted(unknown)} are not options of the loss")
        object.__setattr__(self, "presets", MappingProxyType(dict(self.presets)))
        object.__setattr__(self, "__signature__", self._signature(options))
        object.__setattr__(self, "__doc__", self.kernel.__doc__)

    # ---------------------------------------------------------------------------------------------- metadata

    @property
    def __name__(self) -> str:  # noqa: D401 (mimics a function's name in reprs and error messages)
        return self.name

    def __repr__(self) -> str:
        return f"<policy loss {self.name}>"

    def _kernel_options(self) -> dict[str, inspect.Parameter]:
        params = list(inspect.signature(self.kernel).parameters.values())[1:]
        bad = [p.name for p in params if p.kind is not _KEYWORD]
        if bad:
            raise TypeError(f"{self.name}: kernel options must be keyword-only, got {bad}")
        return {p.name: p for p in params}

    @property
    def option_defaults(self) -> Mapping[str, Any]:
        """The loss's hyper-parameters and their defaults (presets applied)."""
        return MappingProxyType({name: self.presets.get(name, p.default)
                                 for name, p in self._kernel_options().items()})

    @property
    def fields(self) -> tuple[str, ...]:
        """Names of the positional per-token arrays between ``tokens`` and ``mask``."""
        anchor = self.anchor or ("anchor_logprobs" if self.anchor_slot else None)
        return tuple(n for n in (anchor, "advantages" if self.advantages else None) if n)

    @property
    def needs_trainer_logprobs(self) -> bool:
        """Whether the loss reads log-probs of the policy *before the update as the trainer computes them*
        (``old_logprobs``, ``proximal_logprobs``) rather than only the rollout's behaviour log-probs: such a
        loss needs one extra forward pass per rollout when the sampler's numerics or weights differ from the
        trainer's (PPO family, GSPO, SAPO, CISPO, TIS, decoupled PPO; not DPPO, DG, GPG)."""
        return bool({"old_logprobs", "proximal_logprobs"} & set(self.required_arrays()))

    def required_arrays(self, **options) -> tuple[str, ...]:
        """Every per-token array the loss reads with these options: the anchor (if any), ``extras`` and the
        option-dependent ones (e.g. DPPO Top-K's ``topk_ids`` / ``topk_logprobs``)."""
        merged = {**self.option_defaults, **options}
        return ((self.anchor,) if self.anchor else ()) + self.extras + (self.needs(merged) if self.needs else ())

    def preset(self, **presets) -> "PolicyLoss":
        """This loss with other defaults (``aggregation`` included); call-time options still override them."""
        aggregation = presets.pop("aggregation", self.default_aggregation)
        merged = {**self.presets, **presets}
        label = ", ".join(f"{k}={v!r}" for k, v in merged.items())
        return dataclasses.replace(self, name=f"{self.name.split('[')[0]}[{label}]", presets=merged,
                                   default_aggregation=aggregation)

    def with_anchor_slot(self) -> "PolicyLoss":
        """This loss under the registry's uniform positional convention (a positional anchor, ignored)."""
        return self if self.anchor else dataclasses.replace(self, anchor_slot=True)

    def _signature(self, options: Mapping[str, inspect.Parameter]) -> inspect.Signature:
        params = [inspect.Parameter(n, _POSITIONAL) for n in ("logits", "tokens", *self.fields, "mask")]
        params += [inspect.Parameter(n, _KEYWORD) for n in self.extras]
        params += [p.replace(default=self.presets.get(n, p.default)) for n, p in options.items()]
        shared = {f.name: f.default for f in dataclasses.fields(PolicyInputs) if f.name in SHARED_KEYWORDS}
        shared["aggregation"] = self.default_aggregation
        params += [inspect.Parameter(n, _KEYWORD, default=d) for n, d in shared.items()]
        return inspect.Signature(params)

    # ------------------------------------------------------------------------------------------------- calls

    def __call__(self, *args, **kwargs) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The loss as a plain function (see ``inspect.signature(loss)``): returns (loss, metrics)."""
        try:
            arguments = self.__signature__.bind(*args, **kwargs).arguments
        except TypeError as e:
            raise TypeError(f"{self.name}: {e}") from None
        named = {n: arguments.pop(n, None) for n in ("tokens", *self.fields, "mask")}
        inputs = PolicyInputs(
            tokens=named["tokens"], anchor_logprobs=named.get(self.anchor) if self.anchor else None,
            advantages=named.get("advantages"), mask=named["mask"],
            **{n: arguments.pop(n) for n in SHARED_KEYWORDS if n in arguments})
        return self.apply(arguments.pop("logits"), inputs, **arguments)

    def apply(self, logits, inputs: PolicyInputs, **options) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The loss on ``logits`` [B, T, V] and the shared ``inputs``; ``options`` are the loss's own keyword
        arguments and its ``extras`` arrays. Returns (scalar loss, {name: scalar metric})."""
        known = self._kernel_options()
        unknown = sorted(set(options) - set(known) - set(self.extras))
        if unknown:
            raise TypeError(f"{self.name}: unexpected keyword argument(s) {unknown}; the loss's options are "
                            f"{sorted(known)}" + (f" and arrays {list(self.extras)}" if self.extras else ""))
        missing = [n for n in self.extras if n not in options]
        if missing:
            raise TypeError(f"{self.name}: missing the per-token array(s) {missing} (keyword arguments)")
        fields = {self.anchor: inputs.anchor_logprobs} if self.anchor else {}
        if self.advantages:
            fields["advantages"] = inputs.advantages
        fields.update((n, options.pop(n)) for n in self.extras)
        options = {**self.presets, **options}
        aggregation = inputs.aggregation or self.default_aggregation
        extra_ids = None
        if self.gather:
            bt = tuple(check_logits(self.name, logits)[:2])
            extra_ids = self.gather(self.name, bt, {**self.option_defaults, **options})
        batch = prepare(self.name, logits, inputs.tokens, inputs.mask, fields, temperature=inputs.temperature,
                        chunk_size=inputs.chunk_size, aggregation=aggregation, segment_ids=inputs.segment_ids,
                        extra_ids=extra_ids)
        per_token, metrics = self.kernel(batch, **options)
        return finish(per_token, batch, metrics, aggregation=aggregation, normalizer=inputs.normalizer,
                      norm_length=inputs.norm_length)


def policy_loss(name: str, *, anchor: str | None = "old_logprobs", aggregation: str = "token-mean",
                extras: tuple[str, ...] = (), advantages: bool = True, gather=None, needs=None
                ) -> Callable[[Kernel], PolicyLoss]:
    """Decorator: the ``PolicyLoss`` called ``name`` whose formula is the decorated kernel (see the module
    docstring; the keyword arguments are ``PolicyLoss``'s attributes)."""

    def wrap(kernel: Kernel) -> PolicyLoss:
        return PolicyLoss(name=name, kernel=kernel, anchor=anchor, default_aggregation=aggregation, extras=extras,
                          advantages=advantages, gather=gather, needs=needs)

    return wrap


__all__ = ["PolicyInputs", "PolicyLoss", "SHARED_KEYWORDS", "TokenBatch", "policy_loss"]
