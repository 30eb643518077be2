//! MC2 / FUSED_MC2 token prepare with the engine's own choices (SPEC section
//! 6): the pad target the engine sets (vLLM-Ascend's `padded_num_tokens`)
//! and the mask written into a buffer the engine owns (vLLM-Ascend's
//! `_EXTRA_CTX.mc2_mask`, sliced to the TP rank). Expected rows and masks are
//! written out by hand from the SPEC's rule, on the CPU communicator and (the
//! `npu` cases, ignored without an NPU) on NPUs through HCCL.

mod common;

use ascend_moe::moe::prepare_finalize::*;
use ascend_moe::{Collectives, CommType, DType, Error, Tensor};

/// Row `j` of DP rank `d`'s tokens: `[10 d + j + 1, -(10 d + j + 1)]`.
fn batch(d: usize, rows: usize) -> Vec<f32> {
    (0..rows).flat_map(|j| [(10 * d + j + 1) as f32, -((10 * d + j + 1) as f32)]).collect()
}

// DP 2 x TP 2, tokens [3, 2], the engine pads to 6 (the default would be 4)
// and DP rank 0 has 2 real tokens (its third row is graph padding).
backend_test!(mc2_pads_to_the_engines_target_and_writes_its_mask_buffer, ranks = 4, |rank, comm| {
    let (d, t) = (rank / 2, rank % 2);
    let dev = comm.device();
    let mut ctx = MoeContext::new(&[3, 2], 2, d, t, false)?.with_padded_num_tokens(6)?;
    if d == 0 {
        ctx = ctx.with_num_actual_tokens(2)?;
    }
    let groups = MoeGroups::from_world(&comm, 2)?;
    let tokens = [3, 2][d];
    let x = Tensor::from_slice(&batch(d, tokens), &[tokens, 2])?.to_device(&dev)?;
    // The batch padded to 6 rows, TP rank t takes rows [3t, 3t + 3).
    let want_rows: Vec<f32> = (3 * t..3 * t + 3)
        .flat_map(|j| if j < tokens { [(10 * d + j + 1) as f32, -((10 * d + j + 1) as f32)] } else { [0.0, 0.0] })
        .collect();
    let want_mask: Vec<u8> = match (d, t) {
        (0, 0) => vec![1, 1, 0],
        (1, 0) => vec![1, 1, 0],
        _ => vec![0, 0, 0],
    };
    for comm_type in [CommType::Mc2, CommType::FusedMc2] {
        let what = format!("{comm_type:?} rank {rank}");
        assert_eq!(prepare_output_shape(x.shape(), comm_type, &ctx)?, [3, 2], "{what}");
        let p = prepare(&x, comm_type, &ctx, &groups)?;
        assert_eq!(p.hidden.to_vec::<f32>()?, want_rows, "{what}");
        let host_mask: Vec<u8> = p.mc2_mask.clone().unwrap_or_default().into_iter().map(u8::from).collect();
        assert_eq!(host_mask, want_mask, "{what}");

        // The engine's buffer, on the device, prefilled with a value the mask never has.
        for dtype in [DType::Bool, DType::U8] {
            let mut buf = Tensor::from_slice(&[7u8; 3], &[3])?.to_device(&dev)?;
            if dtype == DType::Bool {
                buf = Tensor::from_slice(&[ascend_moe::types::Bool(7); 3], &[3])?.to_device(&dev)?;
            }
            assert!(mc2_mask_into(comm_type, &ctx, &mut buf)?, "{what}");
            assert_eq!(buf.to_cpu()?.cpu_bytes()?, want_mask.as_slice(), "{what} {dtype:?}");
        }

        // Back: TP all-gather of the 6 rows, keep this DP rank's 3 or 2.
        let back = finalize(p.hidden, comm_type, &ctx, &groups)?;
        assert_eq!(back.to_vec::<f32>()?, batch(d, tokens), "{what}");
    }
    // Comm types without a mask leave the buffer alone.
    for comm_type in [CommType::AllGather, CommType::AllToAll] {
        let mut buf = Tensor::from_slice(&[7u8; 3], &[3])?.to_device(&dev)?;
        assert!(!mc2_mask_into(comm_type, &ctx, &mut buf)?);
        assert_eq!(buf.to_cpu()?.cpu_bytes()?, [7, 7, 7]);
    }
    Ok(())
});

#[test]
fn a_pad_target_that_cannot_split_or_hold_the_tokens_is_refused() {
    for (n, why) in [(5, "not a multiple of TP 2"), (2, "fewer rows than the 3 tokens of DP rank 0")] {
        let err = MoeContext::new(&[3, 2], 2, 1, 0, false).unwrap().with_padded_num_tokens(n).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("padded_num_tokens")
                && msg.contains(&n.to_string())
                && msg.contains("TP size 2")
                && msg.contains('3'),
            "{why}: {msg}"
        );
    }
    // The default target is ceil_to(max T_d, TP); an explicit one equal to it changes nothing.
    let c = MoeContext::new(&[3, 2], 2, 1, 0, false).unwrap();
    assert_eq!(c.padded_num_tokens(), 4);
    assert_eq!(
        c.clone().with_padded_num_tokens(4).unwrap(),
        MoeContext::new(&[3, 2], 2, 1, 0, false).unwrap().with_padded_num_tokens(4).unwrap()
    );
    assert_eq!(prepare_output_shape(&[2, 8], CommType::Mc2, &c).unwrap(), [2, 8]);
    let c8 = c.with_padded_num_tokens(8).unwrap();
    assert_eq!(prepare_output_shape(&[2, 8], CommType::Mc2, &c8).unwrap(), [4, 8]);
    assert_eq!(finalize_output_shape(&[4, 8], CommType::Mc2, &c8).unwrap(), [2, 8]);
}

#[test]
fn a_mask_buffer_of_the_wrong_length_or_dtype_is_named() {
    let ctx = MoeContext::new(&[3, 2], 2, 0, 1, false).unwrap();
    let mut short = Tensor::from_slice(&[0u8; 1], &[1]).unwrap();
    let e = mc2_mask_into(CommType::Mc2, &ctx, &mut short).unwrap_err();
    assert!(matches!(e, Error::Shape { .. }), "{e}");
    assert!(e.to_string().contains("mc2_mask") && e.to_string().contains("[2]"), "{e}");
    let mut floats = Tensor::from_slice(&[0f32; 2], &[2]).unwrap();
    let e = mc2_mask_into(CommType::Mc2, &ctx, &mut floats).unwrap_err();
    assert!(e.to_string().contains("mc2_mask") && e.to_string().contains("bool"), "{e}");
    assert_eq!(floats.to_vec::<f32>().unwrap(), [0.0, 0.0]);
}
