"""The one exception type that means "the user asked for something invalid"."""


class ConfigError(ValueError):
    """Bad input: the message names the problem and the valid choices or range, on one line."""


def check_range(name: str, value, lo=None, hi=None, *, lo_open=False, hi_open=False) -> None:
    """Raise ConfigError unless value is a number and lo <= value <= hi (open ends where asked)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    bad = (lo is not None and (value < lo or (lo_open and value == lo))) or (
        hi is not None and (value > hi or (hi_open and value == hi)))
    if bad:
        left = "(" if lo_open else "["
        right = ")" if hi_open else "]"
        rng = f"{left}{'-inf' if lo is None else _num(lo)}, {'inf' if hi is None else _num(hi)}" \
            f"{right}"
        raise ConfigError(f"{name} must be in {rng}, got {value}")


def _num(x) -> str:
    """A bound as a reader wants it: 0.5, 100, 3.4e+38 (not 3.4028234663852886e+38)."""
    return f"{x:.3g}" if isinstance(x, float) and abs(x) >= 1e6 else str(x)


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}, got {value!r}")
