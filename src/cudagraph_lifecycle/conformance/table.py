"""The conformance table as data: each scenario's name, the function that plays it, its expected outcome
(what CUDA gave, measured), and the environment it needs a fresh process for. The table's order is the
order of the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .context import Ctx
from .scenarios_capture import (
    s_capture_on_default_stream,
    s_current_stream_is_per_thread,
    s_default_stream_capture_poisons_random,
    s_failed_capture_destructor_gives_back,
    s_failed_capture_leaves_routing_on,
    s_host_sync_in_capture,
    s_replay_after_reset,
)
from .scenarios_expandable import (
    EXPANDABLE,
    s_expandable_erased_pool_recaptures,
    s_expandable_flush_unmaps_more_runs_than_expansions,
    s_expandable_kept_blocks_freed_after_flush,
    s_expandable_kept_blocks_freed_before_flush,
    s_expandable_no_temporary_survives,
    s_expandable_second_flush_asserts,
    s_expandable_zombie_pool_asserts_on_recapture,
)
from .scenarios_memory import (
    s_autograd_clone_pins_pool,
    s_empty_cache_keeps_live_pool,
    s_intermediates_reused_in_capture,
    s_lazy_pool_fresh_after_retire,
    s_mempool_del_frees_all,
    s_mempool_del_output_alive_pins,
    s_no_grad_clone_does_not_pin,
    s_one_live_output_pins_shared_pool,
    s_output_freed_before_reset,
    s_reserved_large_block,
    s_reserved_medium_block,
    s_reserved_odd_large_block,
    s_reserved_one_mib_block,
    s_reserved_small_block,
    s_runner_kept_output_pins,
    s_runner_release_clean,
    s_segment_visible_then_gone,
    s_separate_pools_not_smaller,
    s_shared_pool_largest_first_smaller,
    s_small_outputs_share_one_segment,
)
from .scenarios_pools import (
    s_capture_without_pool_mints_graph_id,
    s_fresh_handle_capture_replay,
    s_graph_destruction_releases_like_reset,
    s_handle_without_capture_creates_nothing,
    s_handles_count_up,
    s_mempool_recapture_after_host_empty_cache,
    s_mempool_recapture_output_alive,
    s_mempool_two_graphs_use_count,
    s_mempool_use_count_cycle,
    s_poisoned_capture_with_random,
    s_poisoned_new_handle_capture,
    s_poisoned_plain_alloc,
    s_poisoned_randn,
    s_pool_id_before_capture_end,
    s_recreated_pool_keeps_id,
    s_reset_twice_is_noop,
    s_share_graph_pool_after_reset_output_alive,
    s_share_pool_via_graph_pool,
    s_stale_handle_host_cache_only,
    s_stale_handle_output_alive,
    s_stale_handle_output_alive_both_caches,
    s_stale_handle_output_alive_empty_cache,
    s_stale_handle_output_deleted_both_caches,
    s_stale_handle_output_deleted_empty_cache,
    s_stale_handle_output_deleted_no_empty_cache,
    s_torch_graph_context_recaptures_stale_handle,
)


@dataclass(frozen=True)
class Scenario:
    name: str
    fn: Callable[[Ctx], str]
    expected: str
    env: dict[str, str] | None = None  # run in a fresh process with these set, on every backend


SCENARIOS: list[Scenario] = [
    Scenario("fresh_handle_capture_replay", s_fresh_handle_capture_replay, "equal"),
    Scenario("stale_handle_output_alive", s_stale_handle_output_alive, "assert"),
    Scenario("stale_handle_output_alive_empty_cache", s_stale_handle_output_alive_empty_cache, "assert"),
    Scenario("stale_handle_output_deleted_no_empty_cache", s_stale_handle_output_deleted_no_empty_cache, "assert"),
    Scenario("stale_handle_output_deleted_empty_cache", s_stale_handle_output_deleted_empty_cache, "assert"),
    Scenario("stale_handle_output_deleted_both_caches", s_stale_handle_output_deleted_both_caches, "ok"),
    Scenario("stale_handle_output_alive_both_caches", s_stale_handle_output_alive_both_caches, "assert"),
    Scenario("stale_handle_host_cache_only", s_stale_handle_host_cache_only, "assert"),
    Scenario("torch_graph_context_recaptures_stale_handle", s_torch_graph_context_recaptures_stale_handle, "ok"),
    Scenario("recreated_pool_keeps_id", s_recreated_pool_keeps_id, "gone=True back=True same_id=True"),
    Scenario("poisoned_randn", s_poisoned_randn, "assert then poisoned"),
    Scenario("poisoned_plain_alloc", s_poisoned_plain_alloc, "assert then ok"),
    Scenario("poisoned_new_handle_capture", s_poisoned_new_handle_capture, "assert then ok"),
    Scenario("poisoned_capture_with_random", s_poisoned_capture_with_random, "assert then ok"),
    Scenario("pool_id_before_capture_end", s_pool_id_before_capture_end, "pool-without-capture"),
    Scenario("handles_count_up", s_handles_count_up, "up"),
    Scenario("handle_without_capture_creates_nothing", s_handle_without_capture_creates_nothing, "segments=0"),
    Scenario("capture_without_pool_mints_graph_id", s_capture_without_pool_mints_graph_id, "graph-id"),
    Scenario("share_pool_via_graph_pool", s_share_pool_via_graph_pool, "ok"),
    Scenario("share_graph_pool_after_reset_output_alive", s_share_graph_pool_after_reset_output_alive, "assert"),
    Scenario("graph_destruction_releases_like_reset", s_graph_destruction_releases_like_reset, "assert"),
    Scenario("mempool_use_count_cycle", s_mempool_use_count_cycle, "1,2,1"),
    Scenario("mempool_two_graphs_use_count", s_mempool_two_graphs_use_count, "3"),
    Scenario("mempool_recapture_output_alive", s_mempool_recapture_output_alive, "assert"),
    Scenario("mempool_recapture_after_host_empty_cache", s_mempool_recapture_after_host_empty_cache, "ok"),
    Scenario("mempool_del_frees_all", s_mempool_del_frees_all, "2MiB->0MiB"),
    Scenario("mempool_del_output_alive_pins", s_mempool_del_output_alive_pins, "2MiB->0MiB"),
    Scenario("segment_visible_then_gone", s_segment_visible_then_gone, "seen=True after=False"),
    Scenario("reserved_small_block", s_reserved_small_block, "2MiB in 1"),
    Scenario("reserved_one_mib_block", s_reserved_one_mib_block, "2MiB in 1"),
    Scenario("reserved_medium_block", s_reserved_medium_block, "20MiB in 1"),
    Scenario("reserved_large_block", s_reserved_large_block, "24MiB in 2"),
    Scenario("reserved_odd_large_block", s_reserved_odd_large_block, "28MiB in 2"),
    Scenario("intermediates_reused_in_capture", s_intermediates_reused_in_capture, "2MiB"),
    Scenario("small_outputs_share_one_segment", s_small_outputs_share_one_segment, "2MiB in 1"),
    Scenario("one_live_output_pins_shared_pool", s_one_live_output_pins_shared_pool, "20MiB->0MiB"),
    Scenario("empty_cache_keeps_live_pool", s_empty_cache_keeps_live_pool, "2MiB"),
    Scenario("output_freed_before_reset", s_output_freed_before_reset, "0MiB"),
    Scenario("reset_twice_is_noop", s_reset_twice_is_noop, "1"),
    Scenario("replay_after_reset", s_replay_after_reset, "replay-without-capture"),
    Scenario("capture_on_default_stream", s_capture_on_default_stream, "default-stream"),
    Scenario("default_stream_capture_poisons_random", s_default_stream_capture_poisons_random,
             "default-stream, then random: poisoned"),
    Scenario("current_stream_is_per_thread", s_current_stream_is_per_thread,
             "this thread: ok, other thread: default-stream"),
    Scenario("shared_pool_largest_first_smaller", s_shared_pool_largest_first_smaller, "largest-first<=smallest-first: True"),
    Scenario("separate_pools_not_smaller", s_separate_pools_not_smaller, "shared=2MiB separate=8MiB"),
    Scenario("host_sync_in_capture", s_host_sync_in_capture, "capture-invalidated then poisoned, use_count=2"),
    Scenario("failed_capture_destructor_gives_back", s_failed_capture_destructor_gives_back,
             "after reset 2, after del 2"),
    Scenario("failed_capture_leaves_routing_on", s_failed_capture_leaves_routing_on,
             "empty_cache: ok, stream alloc routed: False, routing was on: True, after ending: False, "
             "then empty_cache: ok"),
    Scenario("autograd_clone_pins_pool", s_autograd_clone_pins_pool, "2MiB->0MiB"),
    Scenario("no_grad_clone_does_not_pin", s_no_grad_clone_does_not_pin, "0MiB"),
    Scenario("runner_release_clean", s_runner_release_clean, "equal=True clean=True"),
    Scenario("runner_kept_output_pins", s_runner_kept_output_pins, "pinned=2MiB after-drop=0MiB"),
    Scenario("lazy_pool_fresh_after_retire", s_lazy_pool_fresh_after_retire, "new_id=True capture=ok"),
    Scenario("expandable_kept_blocks_freed_after_flush", s_expandable_kept_blocks_freed_after_flush,
             "crashed: SIGSEGV", EXPANDABLE),
    Scenario("expandable_kept_blocks_freed_before_flush", s_expandable_kept_blocks_freed_before_flush,
             "empty_cache: ok, then: ok", EXPANDABLE),
    Scenario("expandable_flush_unmaps_more_runs_than_expansions", s_expandable_flush_unmaps_more_runs_than_expansions,
             "empty_cache: pool-count-assert", EXPANDABLE),
    Scenario("expandable_no_temporary_survives", s_expandable_no_temporary_survives,
             "first: ok, after the blocks went: ok", EXPANDABLE),
    Scenario("expandable_second_flush_asserts", s_expandable_second_flush_asserts,
             "first: ok, after the blocks went: pool-count-assert", EXPANDABLE),
    Scenario("expandable_zombie_pool_asserts_on_recapture", s_expandable_zombie_pool_asserts_on_recapture,
             "reserved=0MiB recapture=assert", EXPANDABLE),
    Scenario("expandable_erased_pool_recaptures", s_expandable_erased_pool_recaptures,
             "reserved=0MiB recapture=ok", EXPANDABLE),
]
BY_NAME = {s.name: s for s in SCENARIOS}
