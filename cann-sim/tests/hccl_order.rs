//! The order in which the simulated HCCL reduces: rotating from call to call
//! unless the communicator is deterministic (`hcclDeterministic` in its
//! config, else `HCCL_DETERMINISTIC` read at creation), then rank order.
//!
//! HCCL promises no reduction order by default (hicann/hccl
//! `docs/zh/user_guide/hccl_env/HCCL_DETERMINISTIC.md`), so a caller must not
//! expect the bits of a rank-order sum. Three ranks contribute `2^14`,
//! `-2^14` and `2^-24`: in rank order the f32 sum is `(2^14 - 2^14) + 2^-24 =
//! 2^-24`; in every other order `2^-24` is absorbed by a `±2^14` first (f32 has
//! 24 significant bits) and the sum is `0`. `2^-24` is exact in f16 (its
//! smallest subnormal), bf16 and f32, so the two orders give different bytes
//! in all three.

mod common;

use common::*;

const NULL: Ptr = std::ptr::null_mut();
const HCCL_FP16: i32 = 3;
const HCCL_BF16: i32 = 11;
const WORLD: u32 = 3;
/// `HCCL_COMM_DETERMINISTIC_CONFIG_NOT_SET`.
const NOT_SET: u32 = 0xffff_ffff;

/// Rank `r`'s contribution.
fn contribution(r: u32) -> f32 {
    [16384.0, -16384.0, f32::powi(2.0, -24)][r as usize]
}

fn bytes(dt: i32, x: f32) -> Vec<u8> {
    match dt {
        HCCL_FP16 => half::f16::from_f32(x).to_le_bytes().to_vec(),
        HCCL_BF16 => half::bf16::from_f32(x).to_le_bytes().to_vec(),
        _ => x.to_le_bytes().to_vec(),
    }
}

/// A v10 `HcclCommConfig` as `HcclCommConfigInit` leaves it, with
/// `hcclDeterministic` = `deterministic` and a 20 s execution timeout.
fn config(deterministic: u32) -> Vec<u8> {
    let mut c = vec![0u8; 2240];
    c[0..8].copy_from_slice(&2240usize.to_le_bytes());
    c[8..12].copy_from_slice(&0xf0f0_f0f0u32.to_le_bytes());
    c[12..16].copy_from_slice(&10u32.to_le_bytes());
    // hcclBufferSize "not set".
    c[24..28].fill(0xff);
    c[28..32].copy_from_slice(&deterministic.to_le_bytes());
    c[316..320].copy_from_slice(&20i32.to_le_bytes());
    c
}

/// Every rank's results (by rank) of six all-reduces (sum): twice each of
/// f32, f16 and bf16, on a communicator of three ranks made with `cfg`
/// (`None`: `HcclCommInitRootInfo`, no config).
fn sums(cfg: Option<&[u8]>) -> Vec<Vec<(i32, Vec<u8>)>> {
    let s = use_device(0);
    let mut root = vec![0u8; 4108];
    unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
    std::thread::scope(|sc| {
        let hs: Vec<_> = (0..WORLD)
            .map(|r| {
                let root = &root;
                sc.spawn(move || {
                    let s = use_device(r as i32);
                    let mut comm = NULL;
                    let rc = unsafe {
                        match cfg {
                            Some(c) => (s.HcclCommInitRootInfoConfig)(WORLD, root.as_ptr(), r, c.as_ptr(), &mut comm),
                            None => (s.HcclCommInitRootInfo)(WORLD, root.as_ptr(), r, &mut comm),
                        }
                    };
                    assert_eq!(rc, 0, "rank {r}: {}", err_msg());
                    let st = stream();
                    let mut out = Vec::new();
                    for dt in [HCCL_FP32, HCCL_FP16, HCCL_BF16, HCCL_FP32, HCCL_FP16, HCCL_BF16] {
                        let mine = bytes(dt, contribution(r));
                        let send = upload(&mine);
                        let recv = malloc(mine.len());
                        unsafe { assert_eq!((s.HcclAllReduce)(send, recv, 1, dt, HCCL_SUM, comm, st), 0) };
                        sync(st);
                        out.push((dt, download::<u8>(recv, mine.len())));
                        free(send);
                        free(recv);
                    }
                    destroy_stream(st);
                    unsafe { assert_eq!((s.HcclCommDestroy)(comm), 0) };
                    out
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
    })
}

/// Asserts every call gave every rank the same bytes, and those of the
/// rank-order sum (`2^-24`) when `rank_order`, else of any other order (`0`).
fn expect(what: &str, got: &[Vec<(i32, Vec<u8>)>], rank_order: bool) {
    let in_rank_order = (contribution(0) + contribution(1)) + contribution(2);
    assert_eq!(in_rank_order, f32::powi(2.0, -24));
    for (call, (dt, bytes0)) in got[0].iter().enumerate() {
        for (r, rank) in got.iter().enumerate() {
            assert_eq!(&rank[call].1, bytes0, "{what}: call {call}: rank {r} received other bytes than rank 0");
        }
        let want = if rank_order { bytes(*dt, in_rank_order) } else { bytes(*dt, 0.0) };
        assert_eq!(bytes0, &want, "{what}: call {call} (HcclDataType {dt})");
    }
}

#[test]
fn reductions_of_three_ranks_are_not_in_rank_order_by_default() {
    if role().is_some() {
        return;
    }
    expect("config not set, no HCCL_DETERMINISTIC", &sums(Some(&config(NOT_SET))), false);
    expect("config 0", &sums(Some(&config(0))), false);
    expect("no config", &sums(None), false);
}

#[test]
fn the_config_s_hccl_deterministic_reduces_in_rank_order() {
    if role().is_some() {
        return;
    }
    expect("hcclDeterministic 1", &sums(Some(&config(1))), true);
    // 2 (strict) exists from CANN 8.5 on, the simulator's default release.
    if std::env::var("CANNSIM_CANN_VERSION").map_or(true, |v| v == "8.5") {
        expect("hcclDeterministic 2", &sums(Some(&config(2))), true);
    }
}

#[test]
fn hccl_deterministic_reduces_in_rank_order_unless_the_config_turns_it_off() {
    if role().as_deref() == Some("env") {
        // HCCL upper-cases the value (alg_env_config.cc:692): "True" is "TRUE".
        expect("HCCL_DETERMINISTIC, config not set", &sums(Some(&config(NOT_SET))), true);
        expect("HCCL_DETERMINISTIC, no config", &sums(None), true);
        // The communicator's setting wins over the variable.
        expect("HCCL_DETERMINISTIC, config 0", &sums(Some(&config(0))), false);
        return;
    }
    let name = "hccl_deterministic_reduces_in_rank_order_unless_the_config_turns_it_off";
    let o = run_child(name, "env", &[("HCCL_DETERMINISTIC", "True")]);
    assert!(
        o.status.success(),
        "child: {}\n{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
}

#[test]
fn a_bad_hccl_deterministic_value_fails_communicator_creation() {
    if role().as_deref() == Some("bad-env") {
        let s = use_device(0);
        let value = std::env::var("HCCL_DETERMINISTIC").unwrap();
        let root = unhex(&std::env::var("ROOT").unwrap());
        let mut comm = NULL;
        unsafe {
            assert_eq!((s.HcclCommInitRootInfo)(1, root.as_ptr(), 0, &mut comm), 1, "HCCL_E_PARA");
            assert!(err_msg().contains(&format!("HCCL_DETERMINISTIC={value:?}")), "{}", err_msg());
            // HcclGetRootInfo parses it too (hicann/hcomm v8.5.0
            // op_base.cc:873, externalinput.cc:301).
            let mut mine = vec![0u8; 4108];
            assert_eq!((s.HcclGetRootInfo)(mine.as_mut_ptr()), 1, "HCCL_E_PARA");
        }
        assert!(err_msg().contains(&format!("HCCL_DETERMINISTIC={value:?}")), "{}", err_msg());
        return;
    }
    let name = "a_bad_hccl_deterministic_value_fails_communicator_creation";
    let s = use_device(0);
    // Untrimmed, and set but empty is a value (externalinput.cc:617-627).
    for value in ["yes", "", " true"] {
        let mut root = vec![0u8; 4108];
        unsafe { assert_eq!((s.HcclGetRootInfo)(root.as_mut_ptr()), 0, "{}", err_msg()) };
        let o = run_child(name, "bad-env", &[("HCCL_DETERMINISTIC", value), ("ROOT", &hex(&root))]);
        assert_child_passed(&o, &format!("HCCL_DETERMINISTIC={value:?}"));
    }
}
