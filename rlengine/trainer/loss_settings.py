"""``loss_fn_config`` resolved: each loss's settings, checked, with rlengine's defaults.

``loss_settings(loss_fn, config)`` is the one place a loss's options are read: clip
thresholds (ppo, cispo, gspo), dro's ``beta``, ``stable_reinforce``'s truncation, mask and KL
settings, the entropy bonus, the reference KL and the off-policy corrections; a bad key or value
is an ``InvalidRequest`` naming ``loss_fn_config[key]`` and the value. The defaults and where
they come from are in ``rlengine.trainer.losses``' module docstring, beside the formulas.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from rlengine.errors import InvalidRequest

__all__ = ["CORRECTION_KEYS", "DEFAULT_CLIP", "KL_ESTIMATORS", "RATIO_LOSSES", "LossSettings", "StableSettings",
           "as_settings", "clip_thresholds", "loss_settings"]

KL_ESTIMATORS = (1, 2, 3)

DEFAULT_CLIP = {"ppo": (0.8, 1.2), "cispo": (0.0, 4.0), "gspo": (1.0 - 3e-4, 1.0 + 4e-4)}
RATIO_LOSSES = ("importance_sampling", "ppo", "cispo")
CORRECTION_KEYS = ("tis_cap", "mis_cap", "icepop_low", "icepop_high", "geo_mask_low", "geo_mask_high")
_DRO_BETA = 0.05
"""dro's ``beta`` when the caller gives none (``rlengine.trainer.losses``)."""


class StableSettings(NamedTuple):
    """``stable_reinforce``'s settings, by their ``loss_fn_config`` keys; the defaults are rlengine's
    choice (``rlengine.trainer.losses``)."""

    tis_cap: float = 2.0
    geo_mask_low: float = 0.5
    geo_mask_high: float = 2.0
    kl_coeff: float = 0.0


class LossSettings(NamedTuple):
    """What ``loss_fn_config`` says, resolved: clip range and entropy coefficient."""

    clip_low: float
    clip_high: float
    entropy_coef: float = 0.0
    kl_coef: float | None = None
    """None: no reference KL; 0: measured, not penalised."""
    kl_estimator: int = 3
    beta: float = 0.0
    """``dro``'s quadratic penalty coefficient."""
    corrections: tuple[tuple[str, float], ...] = ()
    """The off-policy correction keys set, with their values (``CORRECTION_KEYS`` order)."""
    stable: StableSettings | None = None
    """``stable_reinforce``'s settings (None for the other losses)."""

    def correction(self, key: str) -> float | None:
        return dict(self.corrections).get(key)

    def config(self, loss_fn: str) -> dict[str, float]:
        """The ``loss_fn_config`` that resolves to these settings (for re-validation)."""
        out: dict[str, float] = {}
        if loss_fn in DEFAULT_CLIP:
            out |= {"clip_low_threshold": self.clip_low, "clip_high_threshold": self.clip_high}
        if loss_fn == "dro":
            out["beta"] = self.beta
        if self.entropy_coef:
            out["entropy_coef"] = self.entropy_coef
        if self.kl_coef is not None:
            out |= {"kl_coef": self.kl_coef, "kl_estimator": self.kl_estimator}
        if self.stable is not None:
            out |= self.stable._asdict()
        return out | dict(self.corrections)

    @property
    def masked(self) -> bool:
        """Whether a ``mask`` input weighs the options on top (entropy bonus, reference KL)."""
        return bool(self.entropy_coef) or self.kl_coef is not None


def as_settings(thresholds: tuple[float, ...]) -> LossSettings:
    """``LossSettings`` from what a trainer was handed: settings, or a bare ``(lo, hi)`` pair."""
    if isinstance(thresholds, LossSettings):
        return thresholds
    lo, hi = thresholds
    return LossSettings(float(lo), float(hi))


def loss_settings(loss_fn: str, config: dict[str, Any] | None) -> LossSettings:
    """Resolve ``loss_fn_config``: clip thresholds (ppo, cispo, gspo), ``beta`` (dro) and the options
    on top (any loss)."""
    lo, hi = DEFAULT_CLIP.get(loss_fn, (0.0, math.inf))
    config = config or {}
    known = ("clip_low_threshold", "clip_high_threshold", "entropy_coef", "kl_coef", "kl_estimator", "beta",
             *CORRECTION_KEYS, "kl_coeff")
    for key in config:
        if key not in known:
            raise InvalidRequest(f"loss_fn_config[{key!r}]", config[key], f"unknown key (known: {', '.join(known)})")
    clip_keys = {"clip_low_threshold", "clip_high_threshold"} & set(config)
    if clip_keys and loss_fn not in DEFAULT_CLIP:
        raise InvalidRequest("loss_fn_config", config, f"loss_fn={loss_fn!r} takes no clip thresholds")
    lo = config.get("clip_low_threshold", lo)
    hi = config.get("clip_high_threshold", hi)
    coef = config.get("entropy_coef", 0.0)
    for name, v in (("clip_low_threshold", lo), ("clip_high_threshold", hi), ("entropy_coef", coef)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v) or v < 0:
            raise InvalidRequest(f"loss_fn_config[{name!r}]", v, "must be a number >= 0")
    if math.isinf(coef):
        raise InvalidRequest("loss_fn_config['entropy_coef']", coef, "must be finite")
    if lo > hi:
        raise InvalidRequest("loss_fn_config", config, f"clip_low_threshold {lo} > clip_high_threshold {hi}")
    kl = config.get("kl_coef")
    if kl is not None and (isinstance(kl, bool) or not isinstance(kl, (int, float)) or not math.isfinite(kl)
                           or kl < 0):
        raise InvalidRequest("loss_fn_config['kl_coef']", kl, "must be a finite number >= 0")
    estimator = config.get("kl_estimator", 3)
    if estimator not in KL_ESTIMATORS or isinstance(estimator, bool):
        raise InvalidRequest("loss_fn_config['kl_estimator']", estimator, "must be 1, 2 or 3 (k1, k2, k3)")
    if "kl_estimator" in config and kl is None:
        raise InvalidRequest("loss_fn_config['kl_estimator']", estimator, "needs kl_coef")
    beta = _dro_beta(loss_fn, config)
    if loss_fn == "stable_reinforce":
        return LossSettings(float(lo), float(hi), float(coef), None if kl is None else float(kl), int(estimator),
                            stable=_stable_settings(config))
    if "kl_coeff" in config:
        raise InvalidRequest("loss_fn_config['kl_coeff']", config["kl_coeff"], f"loss_fn={loss_fn!r} takes no "
                             "kl_coeff (stable_reinforce does; the KL to the initial weights is kl_coef)")
    return LossSettings(float(lo), float(hi), float(coef), None if kl is None else float(kl), int(estimator),
                        beta=beta, corrections=_corrections(loss_fn, config))


def _stable_settings(config: dict[str, Any]) -> StableSettings:
    """``stable_reinforce``'s keys of ``config``, checked, defaults filled in (``rlengine.trainer.losses``)."""
    values = {key: config.get(key, default) for key, default in StableSettings()._asdict().items()}
    for key, v in values.items():
        positive = key != "kl_coeff"
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                or (positive and v == 0):
            raise InvalidRequest(f"loss_fn_config[{key!r}]", v, f"must be a finite number {'>' if positive else '>='} 0")
    low, high = values["geo_mask_low"], values["geo_mask_high"]
    if not low <= 1.0 <= high:
        raise InvalidRequest("loss_fn_config", {"geo_mask_low": low, "geo_mask_high": high},
                             "needs geo_mask_low <= 1 <= geo_mask_high")
    for key in ("mis_cap", "icepop_low", "icepop_high"):
        if key in config:
            raise InvalidRequest(f"loss_fn_config[{key!r}]", config[key], "loss_fn='stable_reinforce' takes "
                                 "tis_cap, geo_mask_low, geo_mask_high and kl_coeff (no other correction)")
    return StableSettings(**{key: float(v) for key, v in values.items()})


def _dro_beta(loss_fn: str, config: dict[str, Any]) -> float:
    """``loss_fn_config["beta"]``: dro's penalty coefficient, a finite number >= 0 (dro only; default
    ``_DRO_BETA``)."""
    if "beta" not in config:
        return _DRO_BETA if loss_fn == "dro" else 0.0
    beta = config["beta"]
    if loss_fn != "dro":
        raise InvalidRequest("loss_fn_config['beta']", beta, f"loss_fn={loss_fn!r} takes no beta (dro does)")
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not math.isfinite(beta) or beta < 0:
        raise InvalidRequest("loss_fn_config['beta']", beta, "must be a finite number >= 0")
    return float(beta)


def _corrections(loss_fn: str, config: dict[str, Any]) -> tuple[tuple[str, float], ...]:
    """The off-policy correction keys of ``config``, checked (see ``rlengine.trainer.losses``)."""
    given = [key for key in CORRECTION_KEYS if key in config]
    if not given:
        return ()
    if loss_fn not in RATIO_LOSSES:
        raise InvalidRequest(f"loss_fn_config[{given[0]!r}]", config[given[0]],
                             f"loss_fn={loss_fn!r} has no importance ratio to correct")
    for key in given:
        v = config[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise InvalidRequest(f"loss_fn_config[{key!r}]", v, "must be a finite number > 0")
    token_level = [k for k in ("tis_cap", "mis_cap", "icepop_low") if k in config]
    if len(token_level) > 1:
        raise InvalidRequest("loss_fn_config", {k: config[k] for k in token_level},
                             "at most one of tis_cap, mis_cap and IcePop (icepop_low / icepop_high)")
    for low, high in (("icepop_low", "icepop_high"), ("geo_mask_low", "geo_mask_high")):
        if (low in config) != (high in config):
            missing = high if low in config else low
            raise InvalidRequest(f"loss_fn_config[{missing!r}]", None, f"{low} and {high} go together")
        if low in config and not config[low] <= 1.0 <= config[high]:
            raise InvalidRequest("loss_fn_config", {low: config[low], high: config[high]},
                                 f"needs {low} <= 1 <= {high}")
    return tuple((key, float(config[key])) for key in given)


def clip_thresholds(loss_fn: str, config: dict[str, Any] | None) -> tuple[float, float]:
    """``(clip_low_threshold, clip_high_threshold)`` from ``loss_fn_config`` or the defaults."""
    settings = loss_settings(loss_fn, config)
    return settings.clip_low, settings.clip_high
