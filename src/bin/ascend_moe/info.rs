//! `ascend-moe info`: which backends are usable here.

use ascend_moe::backend::cpu::{
    default_num_threads, env_keep_bytes, env_num_threads, shm_dir, CpuCommConfig, DEFAULT_KEEP_BYTES, KEEP_VAR,
    KEEP_WANTED, MAX_WORLD,
};
use ascend_moe::types::env_switch_setting;
use ascend_moe::CommOptions;

pub fn main() -> i32 {
    println!("ascend-moe {}", env!("CARGO_PKG_VERSION"));
    println!();
    println!("cpu backend: usable");
    let cores = std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1);
    println!("  cores available      {cores}");
    let dir = shm_dir();
    println!("  shared-memory dir    {dir} ({})", free_space(&dir));
    let cfg = CpuCommConfig::default();
    println!(
        "  comm staging         {} KiB x 3 slots per rank ({} KiB shared memory per rank)",
        cfg.effective_staging() / 1024,
        cfg.bytes_per_rank() / 1024
    );
    println!("  max ranks per group  {MAX_WORLD}");
    let source = |var: &str, set: Result<bool, String>, fallback: &str, wanted: &str| match set {
        Ok(true) => var.to_string(),
        Ok(false) => format!("{fallback}: {var} not set"),
        Err(v) => format!("{fallback}: {var}={v:?} ignored, not {wanted}"),
    };
    let threads =
        source("ASCEND_MOE_NUM_THREADS", env_num_threads().map(|t| t.is_some()), "the cores", "a positive integer");
    println!("  kernel threads       up to {} ({threads})", default_num_threads());
    let timeout = source(
        "ASCEND_MOE_COMM_TIMEOUT",
        CommOptions::env_timeout().map(|t| t.is_some()),
        "the default",
        "a positive number of seconds",
    );
    println!("  comm timeout         {:?} ({timeout})", CommOptions::from_env().timeout);
    let switch = |var: &str, default: &str| match env_switch_setting(var) {
        Ok(Some(on)) => format!("{} ({var}={})", if on { "on" } else { "off" }, u8::from(on)),
        Ok(None) => format!("{default} ({var} not set)"),
        Err(v) => format!("{default} ({var}={v:?} ignored, not 1 or 0)"),
    };
    println!("  comm-type check      {}", switch("ASCEND_MOE_CHECK_COMM_TYPE", "on for CPU groups, off over HCCL"));
    println!(
        "  layout check         {}",
        switch("ASCEND_MOE_CHECK_LAYOUT", "off over HCCL, CPU groups compare counts")
    );
    // Not ignored when bad: every pooled allocation fails naming it.
    let mib = |b: usize| if b % (1 << 20) == 0 { format!("{} MiB", b >> 20) } else { format!("{b} bytes") };
    match env_keep_bytes() {
        Ok(Some(0)) => println!("  host pool            keeps no dropped results ({KEEP_VAR}=0)"),
        Ok(Some(b)) => println!("  host pool            keeps up to {} of dropped results ({KEEP_VAR})", mib(b)),
        Ok(None) => println!(
            "  host pool            keeps up to {} of dropped results (the default: {KEEP_VAR} not set)",
            mib(DEFAULT_KEEP_BYTES)
        ),
        Err(v) => println!(
            "  host pool            {KEEP_VAR}={v:?} is not {KEEP_WANTED}: results of 1 MiB or more fail to allocate"
        ),
    }
    println!();
    // ---- NPU / CANN section ------------------------------------------------
    // The NPU backend adds its report here: one library call that returns what
    // was found (CANN version, devices) and every path looked at, printed as is.
    print!("npu backend:\n{}", ascend_moe::backend::npu::probe_report());
    println!();
    vllm_adapter();
    0
}

/// The vLLM-Ascend adapter (`ascend_moe.vllm_ascend`): whether its switch is
/// set here and what `install()` replaces in a vLLM process.
fn vllm_adapter() {
    let switch = std::env::var("ASCEND_MOE_VLLM").ok();
    let state = match switch.as_deref() {
        Some("1") => "on: vLLM processes started from here install it",
        Some(_) => "off (only 1 switches it on)",
        None => "off (not set)",
    };
    println!("vllm-ascend adapter: ASCEND_MOE_VLLM={} {state}", switch.as_deref().unwrap_or(""));
    println!(
        "  replaces             torch.ops.vllm.maybe_all_gather_and_maybe_unpad, torch.ops.vllm.maybe_pad_and_reduce"
    );
    println!("                       AscendMoERunner reduction points (decided from the live comm type)");
    println!("  in a running process ascend_moe.vllm_ascend.status()");
}

fn free_space(dir: &str) -> String {
    let Ok(c) = std::ffi::CString::new(dir) else { return "unknown free space".into() };
    // SAFETY: zeroed statvfs is a valid out-parameter; c is NUL-terminated.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return "unknown free space".into();
    }
    let free = st.f_bavail as u128 * st.f_frsize as u128;
    format!("{:.1} GiB free", free as f64 / (1u64 << 30) as f64)
}
