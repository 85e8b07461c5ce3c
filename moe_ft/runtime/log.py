"""The FT metric line rank 0 prints every ``--ft-log-interval`` iterations."""

from __future__ import annotations


def format_line(iteration: int, m: dict) -> str:
    """``m``: :meth:`FTRuntime.metrics` (snapshot bytes, stall, window, replicas, durable tier, boost)."""
    parts = [f"ft iteration {iteration + 1:6d}", f"policy {m['policy']}"]
    if "snapshots_paused" in m:
        parts.append(f"snapshots paused ({m['snapshots_paused']})")
    if "bytes" in m:
        parts += [f"snapshot {m['bytes'] / 1e6:.3f} MB (FULL {m['full']}, COMPUTE {m['compute']})",
                  f"stall {m['stall_ms']:.2f} ms"]
        if m.get("slot_wait_ms"):
            parts.append(f"slot wait {m['slot_wait_ms']:.2f} ms")
        if "device_stall_ms" in m:
            parts.append(f"device stall {m['device_stall_ms']:.2f} ms")
        if "touched_per_byte" in m:  # the trainer's own host work on the snapshot's bytes
            parts.append(f"trainer {m['touched_per_byte']:.2f} B/B, {m['thread_cpu_ms']:.1f} ms CPU")
    if "window" in m:
        parts.append(f"window {m['window']}")
    if "replication_lag" in m:
        parts.append(f"replica {m['replication_bytes'] / 1e6:.3f} MB lag {m['replication_lag']} it")
    if "recompute_sent" in m:
        parts.append(f"recompute {m['recompute_sent']} grads, {m['recomputed']} rebuilt, "
                     f"{m['recompute_failures']} failed")
    if "durable_paused" in m:
        parts.append(f"durable copies paused ({m['durable_paused']})")
    if "persist_end" in m:
        parts.append(f"durable {m['persist_end'] + 1} ({m['persist_mb_s']:.1f} MB/s)")
    if "agent_verified" in m:
        parts.append(f"agent verified {m['agent_verified']} points")
    if "agent_published" in m:
        parts.append(f"agent published {m['agent_published']} points")
    if "agent_cpu_ms" in m:
        parts.append(f"agent {m['agent_cpu_ms']:.1f} ms CPU/it")
    if "boost_experts" in m:
        parts.append(f"capacity boost {m['boost_experts']} experts, {m['boost_deficit']:.0f} tokens to make up")
    if "bubble_ms" in m:
        parts.append(f"bubbles {m['bubble_ms']:.1f} ms ({100 * m['bubble_copied']:.0f}% of copy)")
    if "upstream_log_bytes" in m:
        parts.append(f"upstream log {m['upstream_log_bytes'] / 1e6:.3f} MB")
    if "t_iter_ms" in m:
        parts.append(f"T_iter {m['t_iter_ms']:.1f} ms")
    parts.append(f"tokens at risk {m['tokens_at_risk']:.0f}")
    return " | ".join(parts)
