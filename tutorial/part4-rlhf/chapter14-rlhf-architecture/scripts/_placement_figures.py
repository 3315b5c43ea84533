"""The three figures of placement.py, drawn from what its ranks recorded: placement.png (which rank held which
model and ran which shards), timeline.png (who did what when) and learning.png (reward and off-policy gap per
iteration). A file starting with _ is a helper, not a script."""

from __future__ import annotations

from mlsys import plot

# args: placement.py's Settings (world_size, plot_dir); results: its per-placement summaries

ROLE_COLUMNS = ("actor", "critic", "reward_model", "reference", "engine")
# One colour per phase, shared by placement.py's timeline and ray_placement.py's: grey is waiting (a collective or
# the driver's next call), not work.
PHASE_LABELS = {"comm": "comm / wait"}
PHASE_COLOURS = {"generate": "C0", "score": "C1", "train": "C2", "weight sync": "C3", "comm / wait": "0.85"}


def draw_placement(results: dict, args) -> None:
    """Which rank held which model and ran which shards, as each rank reported it: one grid per placement, a row
    per rank, a column per model (the parameters it held) and two for the work it did."""
    plt = plot.pyplot()
    names = list(results)
    cols = ["actor", "critic", "reward\nmodel", "reference", "engine\n(actor copy)", "generates\nshards",
            "scores\nshards"]
    fig, axes = plt.subplots(len(names), 1, figsize=(9, 0.5 + (0.55 * args.world_size + 0.6) * len(names)),
                             squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        for rank, held in enumerate(results[name]["placed"]):
            y = args.world_size - 1 - rank
            cells = [f"{held['roles'][r]:,}" if r in held["roles"] else "" for r in ROLE_COLUMNS]
            cells += [", ".join(map(str, held[k])) for k in ("generated", "scored")]
            for c, text in enumerate(cells):
                colour = ("C0" if c < 4 else "C1" if c == 4 else "C2") if text else "white"
                ax.add_patch(plt.Rectangle((c, y), 1, 1, fc=colour, alpha=0.35 if text else 1, ec="gray"))
                ax.text(c + 0.5, y + 0.5, text or "-", ha="center", va="center", fontsize=8)
        ax.set(xlim=(0, len(cols)), ylim=(0, args.world_size))
        ax.set_xticks([c + 0.5 for c in range(len(cols))], cols, fontsize=8)
        ax.xaxis.tick_top()
        ax.set_yticks([args.world_size - r - 0.5 for r in range(args.world_size)],
                      [f"rank {r}" for r in range(args.world_size)])
        ax.grid(False)
        ax.set_title(f"{name}: parameters held per model, and the shards each rank generated and scored",
                     fontsize=9, loc="left", pad=24)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'placement')}")


def draw_timeline(results: dict, args) -> None:
    """Who did what when, one panel per placement; each generate and train bar wide enough to show it carries its
    batch number (a co-located rank with no shard has empty generate and score spans)."""
    plt = plot.pyplot()
    names = list(results)
    fig, axes = plt.subplots(len(names), 1, figsize=(8, 1.0 + 1.1 * len(names) * args.world_size / 2),
                             sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        wall = max((e for events in results[name]["timelines"] for _, _, e in events), default=0.0)
        for rank, events in enumerate(results[name]["timelines"]):
            count = {}  # one generate and one train span per iteration: the k-th is batch k
            for phase, s, e in events:
                ax.barh(rank, e - s, left=s, color=PHASE_COLOURS[PHASE_LABELS.get(phase, phase)], edgecolor="none",
                        height=0.7)
                count[phase] = count.get(phase, 0) + 1
                if phase in ("generate", "train") and e - s > 0.01 * wall:
                    ax.text((s + e) / 2, rank, str(count[phase]), ha="center", va="center", fontsize=6, color="white")
        ax.set_yticks(range(args.world_size))
        ax.set_yticklabels([f"rank {r}" for r in range(args.world_size)])
        ax.invert_yaxis()
        ax.set_title(name, fontsize=10, loc="left")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLOURS.values()]
    fig.legend(handles, list(PHASE_COLOURS), loc="lower center", ncol=5,
               fontsize=8, bbox_to_anchor=(0.5, -0.04))
    axes[-1, 0].set_xlabel("seconds since start")
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'timeline')}")


def draw_learning(results: dict, args) -> None:
    plt = plot.pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.4))
    for name, res in results.items():
        its = range(1, len(res["stats"]) + 1)
        ax1.plot(its, [s["reward"] for s in res["stats"]], "o-", label=name, alpha=0.8)
        ax2.plot(its, [s["off_policy_gap"] for s in res["stats"]], "o-", label=name, alpha=0.8)
    ax1.set_xlabel("iteration"), ax1.set_ylabel("mean reward-model score"), ax1.legend(fontsize=8)
    ax2.set_xlabel("iteration"), ax2.set_ylabel("off-policy gap (nats/token)")
    fig.tight_layout()  # room for the right panel's y label between the two panels
    print(f"figure: {plot.save(fig, args, 'learning')}")


def draw_versions(results: dict, args) -> dict:
    """versions.png: for the disaggregated placements, which weights version (updates the rollout rank had received)
    sampled each batch, as rollout rank 1 recorded it: one row of weights versions (w k, the weights after k
    updates) and one of batches, numbered from 1 as in timeline.png, an arrow from the version to the batch it
    sampled. Batch k can at best be sampled by w k-1, so its lag is k - 1 - version. Returns, per placement, the
    drawn (batch, version, lag) triples."""
    plt = plot.pyplot()
    names = [n for n in ("disaggregated", "async") if n in results and args.world_size > 1]
    drawn = {}
    if not names:
        return drawn
    fig, axes = plt.subplots(len(names), 1, figsize=(7.5, 1.5 * len(names) + 0.4), squeeze=False)
    for ax, name in zip(axes[:, 0], names):
        versions = results[name]["sampled_with"][1]  # rollout rank 1's record
        drawn[name] = [{"batch": k + 1, "version": v, "lag": k - v} for k, v in enumerate(versions)]
        for k in range(len(versions)):
            ax.text(k, 1, f"w{k}", ha="center", va="center", fontsize=8, bbox={"fc": "C2", "alpha": 0.35})
            ax.text(k, 0, f"batch {k + 1}", ha="center", va="center", fontsize=8, bbox={"fc": "C0", "alpha": 0.35})
        for row in drawn[name]:
            ax.annotate("", xy=(row["batch"] - 1, 0.2), xytext=(row["version"], 0.8),
                        arrowprops={"arrowstyle": "->", "color": "C3" if row["lag"] else "0.3"})
        lags = sorted({r["lag"] for r in drawn[name]})
        ax.set_title(f"{'sync' if name == 'disaggregated' else 'async'}: w k = the weights after k updates; lags "
                     f"seen (updates behind the newest): {', '.join(map(str, lags))}", fontsize=9, loc="left")
        ax.set(xlim=(-0.6, len(versions) - 0.4), ylim=(-0.5, 1.5))
        ax.set_yticks([0, 1], ["rollout rank 1\nsamples", "weights\nversion"], fontsize=8)
        ax.set_xticks([])
        ax.grid(False)
    fig.tight_layout()
    print(f"figure: {plot.save(fig, args, 'versions')}")
    return drawn
