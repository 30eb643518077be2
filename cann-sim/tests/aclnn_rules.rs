//! Each input contract of the aclnn operators the simulator enforces
//! (cann-sim/README.md, "Rules"), one test per rule proving the violation is
//! refused with aclnn's code, called through the ops' C signatures.

mod common;

use common::*;

const NULL: Ptr = std::ptr::null_mut();
const PARAM_INVALID: i32 = 161_002;
const TILING_ERROR: i32 = 561_002;

/// A device tensor of `dims` and `dtype` over fresh device memory (freed
/// with the simulator's leak report in mind: the tests here are short).
fn dev(dims: &[i64], dtype: i32) -> Ptr {
    use_device(0);
    let elems: i64 = dims.iter().product();
    let size = if dtype == ACL_FLOAT || dtype == ACL_INT32 { 4 } else { 2 };
    tensor(dims, dtype, malloc((elems.max(1) * size) as usize))
}

fn idx(values: &[i32]) -> Ptr {
    use_device(0);
    tensor(&[values.len() as i64], ACL_INT32, upload(values))
}

/// Phase one of aclnnMoeFinalizeRoutingV2 (optional tensors may be NULL).
#[allow(clippy::too_many_arguments)]
fn finalize(x: Ptr, ri: Ptr, x1: Ptr, x2: Ptr, bias: Ptr, scales: Ptr, expert: Ptr, mode: i64, out: Ptr) -> i32 {
    let s = use_device(0);
    let (mut ws, mut ex) = (0u64, NULL);
    unsafe {
        (s.aclnnMoeFinalizeRoutingV2GetWorkspaceSize)(x, ri, x1, x2, bias, scales, expert, mode, out, &mut ws, &mut ex)
    }
}

/// Phase one and two of aclnnMoeTokenUnpermute, then the stream sync; the
/// first non-zero code.
fn unpermute(tokens: Ptr, sorted: Ptr, probs: Ptr, out: Ptr) -> i32 {
    let s = use_device(0);
    let (mut ws, mut ex) = (0u64, NULL);
    let rc = unsafe {
        (s.aclnnMoeTokenUnpermuteGetWorkspaceSize)(tokens, sorted, probs, false, NULL, out, &mut ws, &mut ex)
    };
    if rc != 0 {
        return rc;
    }
    let st = stream();
    let wsp = malloc(ws.max(1) as usize);
    let rc = unsafe { (s.aclnnMoeTokenUnpermute)(wsp, ws, ex, st) };
    let rc = if rc != 0 { rc } else { unsafe { (s.aclrtSynchronizeStream)(st) } };
    free(wsp);
    destroy_stream(st);
    rc
}

#[test]
fn finalize_refuses_x2_without_x1() {
    let (n, h) = (2i64, 4i64);
    let rc = finalize(
        dev(&[n, h], ACL_FLOAT),
        idx(&[0, 1]),
        NULL,
        dev(&[n, h], ACL_FLOAT),
        NULL,
        NULL,
        NULL,
        0,
        dev(&[n, h], ACL_FLOAT),
    );
    assert_eq!(rc, TILING_ERROR, "{}", err_msg());
    assert!(err_msg().contains("x2 parameter can't be inputted"), "{}", err_msg());
}

#[test]
fn finalize_refuses_f16_data_with_f32_scales() {
    let (n, k, h) = (2i64, 2i64, 4i64);
    let x = dev(&[n * k, h], ACL_FLOAT16);
    let rc =
        finalize(x, idx(&[0, 1, 2, 3]), NULL, NULL, NULL, dev(&[n, k], ACL_FLOAT), NULL, 0, dev(&[n, h], ACL_FLOAT16));
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
    // bf16 data with f32 scales is the registered mixed precision.
    let x = dev(&[n * k, h], ACL_BF16);
    let rc =
        finalize(x, idx(&[0, 1, 2, 3]), NULL, NULL, NULL, dev(&[n, k], ACL_FLOAT), NULL, 0, dev(&[n, h], ACL_BF16));
    assert_eq!(rc, 0, "{}", err_msg());
}

/// The op's generated phase one refuses a dtype outside the op definition
/// (161002) before its tiling checks the attribute and the shapes (561002),
/// so a call wrong in both is a dtype error.
#[test]
fn finalize_reports_dtypes_as_invalid_parameters_and_shapes_and_the_mode_as_tiling_errors() {
    let (n, k, h) = (2i64, 2i64, 4i64);
    let with_scales = |x: Ptr, x1: Ptr, scale_rows: i64, mode: i64, out: Ptr| {
        finalize(x, idx(&[0, 1, 2, 3]), x1, NULL, NULL, dev(&[scale_rows, k], ACL_FLOAT), NULL, mode, out)
    };
    let call = |x: Ptr, x1: Ptr, mode: i64, out: Ptr| with_scales(x, x1, n, mode, out);
    let good = || dev(&[n * k, h], ACL_FLOAT);
    let good_out = || dev(&[n, h], ACL_FLOAT);
    assert_eq!(call(good(), NULL, 0, good_out()), 0, "{}", err_msg());
    // Each case runs when its row is checked, so the message read is its own.
    let tiling: [(&str, &dyn Fn() -> i32, &str); 6] = [
        (
            "scales [N-1, K]",
            &|| with_scales(good(), NULL, n - 1, 0, good_out()),
            "scalesOptional has shape [1, 2], expected [2, 2]",
        ),
        ("x1 [N+1, H]", &|| call(good(), dev(&[n + 1, h], ACL_FLOAT), 0, good_out()), "x1Optional has shape [3, 4]"),
        ("out [N, H+1]", &|| call(good(), NULL, 0, dev(&[n, h + 1], ACL_FLOAT)), "out has shape [2, 5]"),
        ("dropPadMode 4", &|| call(good(), NULL, 4, good_out()), "drop_pad_mode should be [0,3]"),
        ("2-D expandedX in mode 1", &|| call(good(), NULL, 1, good_out()), "should be 3D"),
        ("expandedX [N*K+1, H] in mode 0", &|| call(dev(&[n * k + 1, h], ACL_FLOAT), NULL, 0, good_out()), "N*K = 4"),
    ];
    for (what, run, names) in tiling {
        assert_eq!(run(), TILING_ERROR, "{what}: {}", err_msg());
        assert!(err_msg().contains(names), "{what}: {}", err_msg());
    }
    // A dtype outside the definition is 161002 even with a wrong shape too.
    assert_eq!(call(good(), dev(&[n + 1, h], ACL_FLOAT16), 0, good_out()), PARAM_INVALID, "{}", err_msg());
    assert!(err_msg().contains("x1Optional"), "{}", err_msg());
    assert_eq!(call(good(), NULL, 0, dev(&[n, h], ACL_BF16)), PARAM_INVALID, "{}", err_msg());
    assert_eq!(call(good(), NULL, 9, dev(&[n, h], ACL_BF16)), PARAM_INVALID, "{}", err_msg());
}

#[test]
fn finalize_refuses_fewer_experts_than_k() {
    let (n, k, h, e) = (2i64, 2i64, 4i64, 1i64);
    let rc = finalize(
        dev(&[n * k, h], ACL_FLOAT),
        idx(&[0, 1, 2, 3]),
        NULL,
        NULL,
        dev(&[e, h], ACL_FLOAT),
        dev(&[n, k], ACL_FLOAT),
        tensor(&[n, k], ACL_INT32, upload(&[0i32; 4])),
        0,
        dev(&[n, h], ACL_FLOAT),
    );
    assert_eq!(rc, TILING_ERROR, "{}", err_msg());
    assert!(err_msg().contains("less than K"), "{}", err_msg());
}

/// In the drop-pad modes expandedX is [E, C, H] and the bias needs E rows:
/// one more row is refused though every expert index is in range of it.
#[test]
fn finalize_refuses_a_bias_that_is_not_one_row_per_expert_in_drop_pad_modes() {
    let (n, k, h, e, c) = (2i64, 2i64, 4i64, 3i64, 2i64);
    for mode in [1, 3] {
        for (rows, want) in [(e + 1, TILING_ERROR), (e, 0)] {
            let rc = finalize(
                dev(&[e, c, h], ACL_FLOAT),
                idx(&[0, 1, 2, -1]),
                NULL,
                NULL,
                dev(&[rows, h], ACL_FLOAT),
                dev(&[n, k], ACL_FLOAT),
                tensor(&[n, k], ACL_INT32, upload(&[0i32, 1, 2, 0])),
                mode,
                dev(&[n, h], ACL_FLOAT),
            );
            assert_eq!(rc, want, "mode {mode}, {rows} bias rows: {}", err_msg());
            if want != 0 {
                assert!(err_msg().contains("dim 0 of bias should be 3"), "{}", err_msg());
            }
        }
    }
}

#[test]
fn finalize_refuses_bias_without_expert_idx() {
    let (n, h) = (2i64, 4i64);
    let rc = finalize(
        dev(&[n, h], ACL_FLOAT),
        idx(&[0, 1]),
        NULL,
        NULL,
        dev(&[2, h], ACL_FLOAT),
        NULL,
        NULL,
        0,
        dev(&[n, h], ACL_FLOAT),
    );
    assert_eq!(rc, TILING_ERROR, "{}", err_msg());
    assert!(err_msg().contains("expertIdxOptional"), "{}", err_msg());
}

#[test]
fn finalize_refuses_an_empty_input() {
    let h = 4i64;
    let rc = finalize(dev(&[0, h], ACL_FLOAT), idx(&[]), NULL, NULL, NULL, NULL, NULL, 0, dev(&[0, h], ACL_FLOAT));
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
}

#[test]
fn finalize_fails_an_expanded_row_idx_outside_its_range() {
    // Mode 0: [0, N*K - 1]; 2 is outside for N*K = 2.
    let s = use_device(0);
    let (n, h) = (2i64, 4i64);
    let (x, out) = (dev(&[n, h], ACL_FLOAT), dev(&[n, h], ACL_FLOAT));
    let (mut ws, mut ex) = (0u64, NULL);
    let null = NULL;
    let ri = idx(&[0, 2]);
    let rc = unsafe {
        (s.aclnnMoeFinalizeRoutingV2GetWorkspaceSize)(x, ri, null, null, null, null, null, 0, out, &mut ws, &mut ex)
    };
    assert_eq!(rc, 0, "{}", err_msg());
    let st = stream();
    let wsp = malloc(ws.max(1) as usize);
    unsafe { assert_eq!((s.aclnnMoeFinalizeRoutingV2)(wsp, ws, ex, st), 0) };
    let rc = unsafe { (s.aclrtSynchronizeStream)(st) };
    assert_eq!(rc, 507015, "ACL_ERROR_RT_AICORE_EXCEPTION: a runtime code");
    assert!(err_msg().contains("expandedRowIdx[1] = 2 is outside"), "{}", err_msg());
    free(wsp);
    destroy_stream(st);
}

/// Phase one of aclnnMoeTokenUnpermute with `paddedMode`; its code.
fn unpermute_phase_one(tokens: Ptr, sorted: Ptr, probs: Ptr, padded: bool, out: Ptr) -> i32 {
    let s = use_device(0);
    let (mut ws, mut ex) = (0u64, NULL);
    unsafe { (s.aclnnMoeTokenUnpermuteGetWorkspaceSize)(tokens, sorted, probs, padded, NULL, out, &mut ws, &mut ex) }
}

#[test]
fn unpermute_checks_nulls_then_dtypes_before_the_simulators_own_rules() {
    let (t, h) = (2i64, 4i64);
    // A NULL required tensor first (161001), even with paddedMode set.
    let rc = unpermute_phase_one(NULL, idx(&[0, 1]), NULL, true, dev(&[t, h], ACL_FLOAT));
    assert_eq!(rc, 161_001, "{}", err_msg());
    assert!(err_msg().contains("permutedTokens is NULL"), "{}", err_msg());
    // Then the dtypes of the op definition, before paddedMode and the shapes.
    let f32_idx = tensor(&[t], ACL_FLOAT, upload(&[0.0f32, 1.0]));
    let rc = unpermute_phase_one(dev(&[t, h, 1], ACL_FLOAT), f32_idx, NULL, true, dev(&[t, h], ACL_FLOAT));
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
    assert!(err_msg().contains("sortedIndices is ACL_FLOAT"), "{}", err_msg());
    let rc = unpermute_phase_one(dev(&[t, h], ACL_FLOAT), idx(&[0, 1]), NULL, false, dev(&[t + 1, h], ACL_FLOAT16));
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
    assert!(err_msg().contains("out is ACL_FLOAT16"), "{}", err_msg());
    // Probs of a third float dtype: the simulator's own refusal.
    let rc = unpermute_phase_one(
        dev(&[t, h], ACL_FLOAT16),
        idx(&[0, 1]),
        dev(&[t, 1], ACL_BF16),
        false,
        dev(&[t, h], ACL_FLOAT16),
    );
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
    assert!(err_msg().contains("probsOptional is ACL_BF16"), "{}", err_msg());
    // With every dtype right, paddedMode is refused (the simulator's own rule).
    let rc = unpermute_phase_one(dev(&[t, h], ACL_FLOAT), idx(&[0, 1]), NULL, true, dev(&[t, h], ACL_FLOAT));
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
    assert!(err_msg().contains("paddedMode"), "{}", err_msg());
}

#[test]
fn unpermute_refuses_repeated_sorted_indices() {
    let (t, h) = (2i64, 4i64);
    let rc = unpermute(dev(&[t, h], ACL_FLOAT), idx(&[1, 1]), NULL, dev(&[t, h], ACL_FLOAT));
    assert_eq!(rc, 507015, "the sync's ACL_ERROR_RT_AICORE_EXCEPTION");
    assert!(err_msg().contains("repeats"), "{}", err_msg());
}

#[test]
fn unpermute_refuses_an_index_outside_the_permuted_rows() {
    let (t, h) = (2i64, 4i64);
    let rc = unpermute(dev(&[t, h], ACL_FLOAT), idx(&[0, -1]), NULL, dev(&[t, h], ACL_FLOAT));
    assert_eq!(rc, 507015, "the sync's ACL_ERROR_RT_AICORE_EXCEPTION");
    assert!(err_msg().contains("outside"), "{}", err_msg());
}

#[test]
fn unpermute_needs_t_times_k_permuted_rows() {
    let (t, h) = (2i64, 4i64);
    let rc = unpermute(dev(&[t + 1, h], ACL_FLOAT), idx(&[0, 1]), NULL, dev(&[t, h], ACL_FLOAT));
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
}

#[test]
fn a_launch_scribbles_its_workspace_when_it_runs() {
    let s = use_device(0);
    // permuted [4, 2] f32, four sorted indices, no probs (K = 1): out [4, 2].
    let tokens = tensor(&[4, 2], ACL_FLOAT, upload(&[1.0f32, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]));
    let sorted = idx(&[0, 1, 2, 3]);
    let out = dev(&[4, 2], ACL_FLOAT);
    let (mut ws, mut ex) = (0u64, NULL);
    let rc =
        unsafe { (s.aclnnMoeTokenUnpermuteGetWorkspaceSize)(tokens, sorted, NULL, false, NULL, out, &mut ws, &mut ex) };
    assert_eq!(rc, 0, "{}", err_msg());
    assert!(ws > 0, "the operator asks for a workspace");
    let st = stream();
    let wsp = upload(&vec![0x11u8; ws as usize]);
    assert_eq!(unsafe { (s.aclnnMoeTokenUnpermute)(wsp, ws, ex, st) }, 0, "{}", err_msg());
    // Queued, not run yet on a lazy stream: the workspace still holds what the caller put there.
    if std::env::var("CANNSIM_STREAM_MODE").as_deref() != Ok("eager") {
        assert!(download::<u8>(wsp, ws as usize).iter().all(|&b| b == 0x11));
    }
    sync(st);
    // The run used every byte as scratch: data kept there is gone.
    assert!(download::<u8>(wsp, ws as usize).iter().all(|&b| b == 0xA7), "the workspace was overwritten");
    free(wsp);
    destroy_stream(st);
}

#[test]
fn add_checks_nulls_in_canns_order_then_dtypes_before_shapes() {
    let s = use_device(0);
    let (mut ws, mut ex) = (0u64, NULL);
    let mut one = 1.0f32;
    let alpha = unsafe { (s.aclCreateScalar)(&mut one as *mut f32 as Ptr, ACL_FLOAT) };
    let (a, b) = (dev(&[2, 4], ACL_FLOAT), dev(&[2, 4], ACL_FLOAT));
    // self, other, alpha, out: a NULL alpha is named before a NULL out.
    let rc = unsafe { (s.aclnnAddGetWorkspaceSize)(a, b, NULL, NULL, &mut ws, &mut ex) };
    assert_eq!(rc, 161_001, "{}", err_msg());
    assert!(err_msg().contains("alpha is NULL"), "{}", err_msg());
    // The dtypes before the shapes: `other` of another shape, `out` of another dtype.
    let (short, f16_out) = (dev(&[2, 3], ACL_FLOAT), dev(&[2, 4], ACL_FLOAT16));
    let rc = unsafe { (s.aclnnAddGetWorkspaceSize)(a, short, alpha, f16_out, &mut ws, &mut ex) };
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
    assert!(err_msg().contains("out is ACL_FLOAT16"), "{}", err_msg());
    let rc = unsafe { (s.aclnnAddGetWorkspaceSize)(a, short, alpha, dev(&[2, 4], ACL_FLOAT), &mut ws, &mut ex) };
    assert_eq!(rc, PARAM_INVALID, "{}", err_msg());
    assert!(err_msg().contains("other has shape [2, 3]"), "{}", err_msg());
    unsafe { assert_eq!((s.aclDestroyScalar)(alpha), 0) };
}
