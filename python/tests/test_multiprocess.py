"""4 Python processes rendezvous over the CPU communicator (SPEC section 8)
and run the op matrix and the error paths."""

import workers
from world import run_world

WORLD = 4


def test_op_matrix_across_4_processes():
    results, _ = run_world(workers.op_matrix, WORLD)
    assert sorted(results) == list(range(WORLD))
    counts = set(results.values())
    assert len(counts) == 1 and counts.pop() >= 300, results


def test_error_paths_raise_on_every_rank_within_the_timeout():
    results, _ = run_world(workers.error_paths, WORLD)
    slack = 5.0  # process scheduling on a loaded machine
    for rank, seen in results.items():
        assert seen["numpy_float64"][0] == "DTYPE", seen
        assert "float64" in seen["numpy_float64"][2]
        assert seen["int_data"][0] == "DTYPE" and "expanded_x" in seen["int_data"][2], seen
        assert seen["index_out_of_range"][0] == "INDEX_OUT_OF_RANGE" and "99" in seen["index_out_of_range"][2]
        for case in ("collective_dtype", "wrong_rows", "mismatch"):
            status, secs, msg = seen[case]
            assert secs < workers.SHORT_TIMEOUT_S + slack, (rank, case, secs, msg)
            assert msg, (rank, case)
        if rank == 1:
            # The rank with the bad input learns it from the shape check, before any collective.
            assert seen["wrong_rows"][0] == "SHAPE" and "rows" in seen["wrong_rows"][2], seen["wrong_rows"]
        else:
            assert seen["wrong_rows"][0].startswith("COMM_"), seen["wrong_rows"]
        assert seen["mismatch"][0].startswith("COMM_"), seen["mismatch"]
        assert seen["collective_dtype"][0].startswith("COMM_"), seen["collective_dtype"]


def test_killed_peer_fails_the_survivors_within_the_timeout():
    results, codes = run_world(workers.killed_peer, WORLD, expect_exit=(WORLD - 1,))
    assert codes[WORLD - 1] == 17
    assert sorted(results) == list(range(WORLD - 1))
    for rank, (status, secs, msg) in results.items():
        assert status.startswith("COMM_"), (rank, status, msg)
        assert secs < workers.SHORT_TIMEOUT_S + 5.0, (rank, secs, msg)


def test_token_prepare_finalize_round_trip_across_4_processes():
    results, _ = run_world(workers.prepare_finalize, WORLD)
    assert results == {r: 8 for r in range(WORLD)}


def test_shared_expert_helpers_across_4_processes():
    results, _ = run_world(workers.shared_helpers, WORLD)
    assert results == {r: 16 for r in range(WORLD)}


def test_pcp_and_num_actual_tokens_across_4_processes():
    results, _ = run_world(workers.pcp_actual, WORLD)
    assert results == {r: 2 for r in range(WORLD)}


def test_comm_type_disagreement_fails_every_process_naming_the_ranks():
    results, _ = run_world(workers.comm_type_disagreement, WORLD)
    assert sorted(results) == list(range(WORLD))
    for rank, (status, secs, msg) in results.items():
        assert status == "INVALID_ARGUMENT", (rank, status, msg)
        assert "ranks 0, 1 chose ALLGATHER" in msg and "ranks 2, 3 chose MC2" in msg, (rank, msg)
        assert secs < workers.SHORT_TIMEOUT_S, (rank, secs, msg)


def test_reduction_points_fail_every_tp_rank_when_the_ranks_disagree():
    """SPEC section 5: TP ranks that chose different comm types fail the
    reduction point on every rank, naming the choices; SPEC section 8: a rank
    with no rows still meets its peer in the collective, so both fail."""
    results, _ = run_world(workers.reduction_point_disagreements, WORLD)
    assert sorted(results) == list(range(WORLD))
    for rank, ((status, secs, msg), helpers) in results.items():
        assert secs < workers.SHORT_TIMEOUT_S + 5.0, (rank, secs, msg)
        if rank < 2:
            assert status == "INVALID_ARGUMENT", (rank, status, msg)
            assert "rank 0 chose ALLGATHER" in msg and "rank 1 chose MC2" in msg and "TP ranks" in msg, (rank, msg)
        else:
            assert status.startswith("COMM_"), (rank, status, msg)
        assert all(h.startswith("COMM_") for h in helpers), (rank, helpers)


def test_quantized_dtypes_move_as_bytes_across_4_processes():
    results, _ = run_world(workers.byte_moves, WORLD)
    assert results == {r: 21 for r in range(WORLD)}


def test_handle_ids_differ_between_ranks_and_worlds_created_in_the_same_order():
    """A torch graph holds a communicator as its handle id, and the output shapes
    of its collectives depend on the rank and world size behind it. Processes
    that open their communicators in the same order must still get ids that
    differ wherever the rank or the world size does, so that a compiled-graph
    cache shared by the processes (Inductor's, on disk) keys them apart."""
    pair, _ = run_world(workers.first_handle_id, 2)
    alone, _ = run_world(workers.first_handle_id, 1)
    ids = [pair[0], pair[1], alone[0]]
    assert len(set(ids)) == 3, ids
