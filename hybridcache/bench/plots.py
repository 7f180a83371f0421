"""PNG figures of the simulator and the engine benchmark (matplotlib, the `bench` extra; Agg backend)."""

from __future__ import annotations

from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_hit_rate_sweep(path: str | Path, title: str, memory_gib: list[float],
                        hit_rates: dict[str, list[float]]) -> Path:
    """Token hit rate versus cache memory, one line per policy (`hit_rates[policy][i]` at `memory_gib[i]`)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rates in hit_rates.items():
        style = "--" if name in ("oracle", "none") else "-"
        ax.plot(memory_gib, rates, style, marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_ylim(0, 1)
    return _finish(fig, ax, path, title, "cache memory (GiB, KV + checkpoint states)", "token hit rate")


# A TTFT axis turns logarithmic when one mode's median is this many times another's: on a linear axis the
# fast modes would be squeezed against zero by the slow one.
LOG_AXIS_SPREAD = 10.0


def ttft_axis_is_log(ttfts_s: dict[str, list[float]]) -> bool:
    """Whether the TTFT CDF needs a log axis: the largest median over the smallest is >= LOG_AXIS_SPREAD.

    Example: medians none 900 ms, block-aligned 300 ms, hybridcache 40 ms -> 900 / 40 = 22.5 -> log."""
    medians = [sorted(v)[len(v) // 2] for v in ttfts_s.values() if v]
    return len(medians) > 1 and min(medians) > 0 and max(medians) / min(medians) >= LOG_AXIS_SPREAD


def plot_ttft_cdf(path: str | Path, title: str, ttfts_s: dict[str, list[float]]) -> Path:
    """CDF of time to first token, one line per mode; the axis is logarithmic where `ttft_axis_is_log`."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, values in ttfts_s.items():
        values = sorted(v * 1000 for v in values)
        if values:
            ax.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=mode)
    xlabel = "time to first token (ms)"
    if ttft_axis_is_log(ttfts_s):
        ax.set_xscale("log")
        xlabel += ", log scale"
    return _finish(fig, ax, path, title, xlabel, "fraction of requests")


def plot_hit_rate_by_turn(path: str | Path, title: str, by_turn: dict[str, dict[int, float]]) -> Path:
    """Token hit rate of each conversation turn, one line per mode."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for mode, rates in by_turn.items():
        turns = sorted(rates)
        ax.plot(turns, [rates[t] for t in turns], marker="o", label=mode)
    ax.set_ylim(0, 1)
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # turns are whole numbers
    return _finish(fig, ax, path, title, "turn", "token hit rate")


def _finish(fig, ax, path: str | Path, title: str, xlabel: str, ylabel: str) -> Path:
    """Label, grid and legend a one-axes figure, then save it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return _save(fig, path)


def _save(fig, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
