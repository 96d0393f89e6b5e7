"""The service's Prometheus collector on its own: which metrics appear for which figures."""

from prometheus_client import CollectorRegistry, generate_latest

from o3edge.ipc.metrics import RequestCounter, ServiceCollector


def exposition(figures: dict) -> str:
    registry = CollectorRegistry()
    registry.register(ServiceCollector(lambda: figures, RequestCounter()))
    return generate_latest(registry).decode()


def test_cold_tier_metrics_appear_only_while_the_tier_is_on():
    kv = {"kv_blocks_total": 8, "kv_blocks_used": 1, "kv_blocks_free": 7}
    cold = {"cold_blocks": 5, "cold_bytes": 5 << 20, "cold_hit_tokens": 96, "cold_restored_blocks": 3,
            "cold_offloaded_blocks": 9, "cold_checksum_failures": 1, "cold_evicted": 2,
            "cold_offload_gb_per_s": 3.5, "cold_restore_gb_per_s": 2.9}
    off, on = exposition({**kv, "cold_tier": "off"}), exposition({**kv, **cold})
    assert "kv_cold" not in off
    for line in ("o3edge_kv_cold_blocks 5.0", "o3edge_kv_cold_bytes 5.24288e+06", "o3edge_kv_cold_hit_tokens_total 96.0",
                 "o3edge_kv_cold_checksum_failures_total 1.0", "o3edge_kv_cold_evicted_blocks_total 2.0",
                 "o3edge_kv_cold_restore_gb_per_second 2.9", "o3edge_kv_cold_offload_gb_per_second 3.5"):
        assert line in on, line


def test_the_daemons_defences_are_counted():
    """Bad messages, dropped clients, messages from reserved routing ids and requests of closed processes: counters an
    operator can alert on (a client probing the daemon shows there first)."""
    text = exposition({"bad_messages": 7, "dropped_peers": 3, "reserved_ids": 2, "from_closed_processes": 5})
    for line in ("o3edge_bad_messages_total 7.0", "o3edge_clients_dropped_total 3.0",
                 "o3edge_reserved_id_messages_total 2.0", "o3edge_closed_process_requests_total 5.0"):
        assert line in text, line
