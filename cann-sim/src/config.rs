//! Environment of the simulator, read once per process at the first call.
//!
//! | variable | meaning | default |
//! |---|---|---|
//! | `CANNSIM_DEVICES` | number of devices on the simulated host | 4 |
//! | `ASCEND_RT_VISIBLE_DEVICES` | CANN's own: the host's devices this process sees, as CANN parses it (see [`visible_devices`]) | all |
//! | `CANNSIM_DEVICE_MEM` | bytes per device (suffix K/M/G allowed) | 4G |
//! | `CANNSIM_STREAM_MODE` | `lazy`: queued work runs only when something waits for it; `eager`: as soon as possible | lazy |
//! | `CANNSIM_MALLOC_FILL` | byte written into fresh device memory, or `none` | 0xFF (NaN for every float type) |
//! | `CANNSIM_FAIL_MALLOC_AFTER` | the allocation after this many successful ones fails (OOM) | off |
//! | `CANNSIM_HCCL_TIMEOUT_RANK` | this world rank hangs in every collective (silent for twice the timeout, then `HCCL_E_TIMEOUT`): its peers time out | off |
//! | `CANNSIM_DIE_RANK` | this world rank's process exits at its first collective | off |
//! | `CANNSIM_DIE_EXIT_CODE` | exit status of the dying rank | 77 |
//! | `CANNSIM_LEAK_REPORT` | `1`: print the leak report at exit; `fail`: also exit non-zero on leaks | off |
//! | `CANNSIM_LEAK_EXIT_CODE` | exit status for `fail` | 97 |
//! | `CANNSIM_SOC_NAME` | `aclrtGetSocName()` | Ascend910B1 |
//! | `CANNSIM_TRACE` | `1`: print every failing call to stderr | off |
//! | `CANNSIM_CANN_VERSION` | the emulated CANN release, `8.1`, `8.3` or `8.5` (see [`crate::version`]) | 8.5 |
//! | `HCCL_EXEC_TIMEOUT` | HCCL's own: seconds a collective waits for its peers on the device, unless the communicator's `HcclCommConfig` of version 8 or later sets `hcclExecTimeOut` (CANN 8.5 only); `0` never times out (read at each communicator creation, see [`exec_timeout`]) | 1836 |
//! | `HCCL_DFS_CONFIG` | HCCL's own: `inconsistent_check:on` makes `HcclGetCommAsyncError` report a later collective whose ranks disagree on its type, dtype, operation, root or count as `HCCL_E_PARA`, unless `cluster_heartbeat:off` (see [`inconsistent_check`]) | off |
//! | `HCCL_CONNECT_TIMEOUT` | HCCL's own: seconds, 120 to 7200, a rank waits for its peers to join a communicator or to set up a collective's links; the wait is this plus 20 s (see [`connect_timeout`]) | 120 |

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::Duration;

use crate::version::CannVersion;

/// Parsed configuration.
#[derive(Debug, Clone)]
pub struct Config {
    /// Devices this process sees (`aclrtGetDeviceCount`): the device ids
    /// of the ACL calls are `0..devices`.
    pub devices: u32,
    /// Devices of the simulated host (`CANNSIM_DEVICES`).
    pub host_devices: u32,
    /// `ASCEND_RT_VISIBLE_DEVICES`, when set.
    pub visible_var: Option<String>,
    /// The host device behind each id this process sees.
    pub physical: Vec<u32>,
    /// Why `ASCEND_RT_VISIBLE_DEVICES` gives this process no device, when it
    /// does not (`devices` is then 0).
    pub visible_refused: Option<String>,
    /// Bytes of memory per device.
    pub device_mem: usize,
    /// Lazy stream execution.
    pub lazy: bool,
    /// Fill byte for fresh allocations.
    pub malloc_fill: Option<u8>,
    /// Fail the allocation after this many successful ones.
    pub fail_malloc_after: Option<u64>,
    /// World rank whose collectives never arrive.
    pub hccl_timeout_rank: Option<u32>,
    /// World rank whose process dies at its first collective.
    pub die_rank: Option<u32>,
    /// Exit status of the dying rank.
    pub die_exit_code: i32,
    /// Leak report mode.
    pub leak_report: LeakMode,
    /// Exit status when leaks are found in `fail` mode.
    pub leak_exit_code: i32,
    /// SoC name.
    pub soc_name: String,
    /// Print failing calls.
    pub trace: bool,
    /// `HCCL_DFS_CONFIG` turns on HCCL's inconsistent-op check
    /// ([`inconsistent_check`]).
    pub inconsistent_check: bool,
    /// The emulated CANN release.
    pub cann_version: CannVersion,
}

/// What to do with the leak report at exit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeakMode {
    /// Nothing.
    Off,
    /// Print it to stderr.
    Print,
    /// Print it and exit non-zero when something leaked.
    Fail,
}

fn var(name: &str) -> Option<String> {
    std::env::var(name).ok().map(|s| s.trim().to_string()).filter(|s| !s.is_empty())
}

/// Parses `123`, `0x40`, `64K`, `512M`, `4G`.
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let (num, mul) = match s.chars().last()? {
        'k' | 'K' => (&s[..s.len() - 1], 1usize << 10),
        'm' | 'M' => (&s[..s.len() - 1], 1 << 20),
        'g' | 'G' => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    let v = if let Some(h) = num.strip_prefix("0x") { usize::from_str_radix(h, 16).ok()? } else { num.parse().ok()? };
    v.checked_mul(mul)
}

impl Config {
    fn from_env() -> Config {
        let leak_report = match var("CANNSIM_LEAK_REPORT").as_deref() {
            Some("fail") => LeakMode::Fail,
            Some("0") | Some("off") | None => LeakMode::Off,
            Some(_) => LeakMode::Print,
        };
        let malloc_fill = match var("CANNSIM_MALLOC_FILL").as_deref() {
            Some("none") => None,
            Some(s) => parse_size(s).map(|v| v as u8).or(Some(0xFF)),
            None => Some(0xFF),
        };
        let host_devices =
            var("CANNSIM_DEVICES").and_then(|s| s.parse().ok()).filter(|n| (1..=64).contains(n)).unwrap_or(4);
        // Unset is every device; set, even to "", it is parsed.
        let visible = std::env::var_os("ASCEND_RT_VISIBLE_DEVICES").map(std::os::unix::ffi::OsStringExt::into_vec);
        let (physical, visible_refused) = match visible_devices(visible.as_deref(), host_devices) {
            Ok(ids) => (ids, None),
            Err(why) => (Vec::new(), Some(why)),
        };
        Config {
            devices: physical.len() as u32,
            host_devices,
            visible_var: visible.as_deref().map(|v| String::from_utf8_lossy(v).into_owned()),
            physical,
            visible_refused,
            device_mem: var("CANNSIM_DEVICE_MEM")
                .and_then(|s| parse_size(&s))
                .filter(|n| *n >= 4096)
                .unwrap_or(4 << 30),
            lazy: !matches!(var("CANNSIM_STREAM_MODE").as_deref(), Some("eager")),
            malloc_fill,
            fail_malloc_after: var("CANNSIM_FAIL_MALLOC_AFTER").and_then(|s| s.parse().ok()),
            hccl_timeout_rank: var("CANNSIM_HCCL_TIMEOUT_RANK").and_then(|s| s.parse().ok()),
            die_rank: var("CANNSIM_DIE_RANK").and_then(|s| s.parse().ok()),
            die_exit_code: var("CANNSIM_DIE_EXIT_CODE").and_then(|s| s.parse().ok()).unwrap_or(77),
            leak_report,
            leak_exit_code: var("CANNSIM_LEAK_EXIT_CODE").and_then(|s| s.parse().ok()).unwrap_or(97),
            inconsistent_check: inconsistent_check(var("HCCL_DFS_CONFIG").as_deref()),
            soc_name: var("CANNSIM_SOC_NAME").unwrap_or_else(|| "Ascend910B1".to_string()),
            trace: matches!(var("CANNSIM_TRACE").as_deref(), Some("1") | Some("true")),
            cann_version: match var("CANNSIM_CANN_VERSION") {
                None => CannVersion::V8_5,
                // An unknown release must not silently emulate another one: the
                // panic becomes an internal error of every call, with this message.
                Some(v) => CannVersion::parse(&v)
                    .unwrap_or_else(|| panic!("CANNSIM_CANN_VERSION={v:?} is not one of 8.1, 8.3, 8.5")),
            },
        }
    }
}

/// The host devices `ASCEND_RT_VISIBLE_DEVICES` (`raw`, `None` when unset)
/// makes visible on a host of `host_devices`, in the order of the ids this
/// process uses; `Err` names why it makes none visible.
///
/// hicann/runtime v8.5.0 `src/runtime/feature/src/runtime.cc`: the runtime
/// reads the variable once, at its initialisation (`Runtime::Init`, `:930`),
/// and a bad value does not fail `aclInit`. `SplitString` (`:4648-4690`):
/// no token unless the value starts with a digit; runs of digits separated by
/// single commas, read up to the first other character or the second comma
/// in a row (the value's first 128 characters only). `GetVisibleDevices`
/// (`:4836-4947`): the tokens in turn, up to the first id that is not a
/// device of the host (`std::stoi`, so one beyond `i32` too) and at most
/// `host_devices` of them; an id below the one before it
/// (`RT_ALL_ORDER_ERROR`, "it must be configured in ascending order") or
/// equal to an earlier one (`RT_ALL_DUPLICATED_ERROR`) makes none visible,
/// and so does a list with no id read (`RT_ALL_DATA_ERROR`). The runtime
/// guide says the same (`docs/zh/env_vars/ASCEND_RT_VISIBLE_DEVICES.md`:
/// "1, 2,3" reads 1; "1,3,8" on 8 devices reads 1 and 3; ascending only).
/// `ApiImpl::GetDeviceCount` (`api_impl.cc:3239-3276`) then answers the
/// count of ids read, or `RT_ERROR_DRV_NO_DEVICE` (ACL_ERROR_RT_NO_DEVICE,
/// `errcode_manage.cc:82`) for each of the three errors; `aclrtSetDevice`
/// and `aclrtResetDevice` take an id below that count
/// (`ChgUserDevIdToDeviceId`, `runtime.cc:4721-4737`, from
/// `api_error.cc:2510-2518` and `:2648-2651`), none when the list was
/// refused (`userDeviceCnt` stays 0).
pub fn visible_devices(raw: Option<&[u8]>, host_devices: u32) -> Result<Vec<u32>, String> {
    let Some(raw) = raw else { return Ok((0..host_devices).collect()) };
    let text = &raw[..raw.len().min(128)];
    let mut tokens: Vec<Vec<u8>> = Vec::new();
    if text.first().is_some_and(u8::is_ascii_digit) {
        let (mut digits, mut commas) = (Vec::new(), 0);
        for &c in text {
            if c.is_ascii_digit() {
                digits.push(c);
                commas = 0;
                continue;
            }
            if !digits.is_empty() {
                tokens.push(std::mem::take(&mut digits));
            }
            commas += 1;
            if c != b',' || commas > 1 {
                break;
            }
        }
        if !digits.is_empty() {
            tokens.push(digits);
        }
    }
    let refuse = |what: &str| {
        let value = String::from_utf8_lossy(raw);
        Err(format!("ASCEND_RT_VISIBLE_DEVICES={value:?} is invalid (EE2002): {what}"))
    };
    let mut ids: Vec<u32> = Vec::new();
    for t in tokens {
        // `std::stoi`: a value beyond i32 throws and is read as no device.
        let id = std::str::from_utf8(&t).ok().and_then(|s| s.parse::<i32>().ok()).and_then(|v| u32::try_from(v).ok());
        let Some(id) = id.filter(|id| *id < host_devices) else { break };
        if ids.last().is_some_and(|prev| id < *prev) {
            return refuse("the device ids must be configured in ascending order");
        }
        if ids.contains(&id) {
            return refuse("the device ids cannot be duplicated");
        }
        ids.push(id);
        if ids.len() as u32 >= host_devices {
            break;
        }
    }
    if ids.is_empty() {
        return refuse(&format!("no device id in [0, {host_devices}) is read from it"));
    }
    Ok(ids)
}

/// The host device behind id `device` of this process.
pub fn physical(device: u32) -> u32 {
    get().physical.get(device as usize).copied().unwrap_or(device)
}

/// The process-wide configuration.
pub fn get() -> &'static Config {
    static CFG: OnceLock<Config> = OnceLock::new();
    CFG.get_or_init(Config::from_env)
}

impl CannVersion {
    /// The emulated release of this process (from [`get`]; the version module
    /// knows the releases, this one reads which is emulated).
    pub fn current() -> CannVersion {
        get().cann_version
    }
}

/// Whether `HCCL_DFS_CONFIG` (`dfs`, `None` when unset) turns on HCCL's
/// check that the ranks of a communicator call the same collectives.
///
/// hcomm v8.5.0 `src/framework/common/src/config/env_config.cc`:
/// `ParseDFSConfig` (`:514-572`) drops the spaces of the value, lowercases
/// it and reads each item at its first occurrence up to the next comma
/// (`ParseSingleDFSConfigItem`, `:496-512`); `on` and `off` set a switch,
/// any other value keeps the default (a warning): `cluster_heartbeat` on,
/// `inconsistent_check` off (`env_config.h:97-101`). The check runs over the
/// heartbeat, which registers no ranks when it is off
/// (`heartbeat.cc:286-291`).
pub fn inconsistent_check(dfs: Option<&str>) -> bool {
    let Some(dfs) = dfs else { return false };
    let dfs: String = dfs.chars().filter(|&c| c != ' ').collect::<String>().to_ascii_lowercase();
    let item = |name: &str| {
        let start = dfs.find(name)? + name.len();
        let rest = &dfs[start..];
        Some(rest[..rest.find(',').unwrap_or(rest.len())].to_string())
    };
    let switch = |name: &str, default: bool| match item(name).as_deref() {
        Some("on") => true,
        Some("off") => false,
        _ => default,
    };
    switch("cluster_heartbeat:", true) && switch("inconsistent_check:", false)
}

/// The execution timeout of a communicator whose config sets no
/// `hcclExecTimeOut`: `HCCL_EXEC_TIMEOUT` seconds, else HCCL's default of
/// 1836 s (`None`: `0`, never time out).
///
/// hicann/hccl `docs/zh/user_guide/hccl_env/HCCL_EXEC_TIMEOUT.md` (v9.1.0):
/// A2 default 1836 s, range [0, 2147483647], 0 = never time out; the
/// communicator's `hcclExecTimeOut` wins over it. `ParseExecTimeout`
/// (`src/common/alg_env_config.cc:69-104`, v9.1.0) accepts a non-negative
/// number with at most 2 decimals and fails the initialisation with
/// HCCL_E_PARA otherwise (EI0001, `alg_env_config.cc:244-251`).
pub fn exec_timeout() -> Result<Option<Duration>, String> {
    const DEFAULT: Duration = Duration::from_secs(1836);
    let Some(v) = var("HCCL_EXEC_TIMEOUT") else { return Ok(Some(DEFAULT)) };
    let well_formed = {
        let (int, frac) = v.split_once('.').unwrap_or((&v, ""));
        !int.is_empty()
            && int.bytes().all(|b| b.is_ascii_digit())
            && frac.len() <= 2
            && frac.bytes().all(|b| b.is_ascii_digit())
            && !(v.contains('.') && frac.is_empty())
    };
    let secs = v.parse::<f64>().ok().filter(|s| well_formed && *s <= u32::MAX as f64);
    match secs {
        None => Err(format!("HCCL_EXEC_TIMEOUT={v:?} is not a non-negative number with up to 2 decimals (EI0001)")),
        // 0: never time out.
        Some(s) => Ok((s > 0.0).then(|| Duration::from_secs_f64(s))),
    }
}

/// Whether HCCL's reductions are deterministic by default:
/// `HCCL_DETERMINISTIC`, read when a communicator is created.
///
/// hicann/hccl v8.5.0 `src/common/alg_env_config.cc:686-714`
/// (`ParseDeterministic`): unset is `false`; the value is upper-cased and must
/// be `TRUE`, `FALSE` or `STRICT`, anything else fails the initialisation
/// with HCCL_E_PARA (EI0001, `alg_env_config.cc:34-40`: "Value should be true
/// ,false or strict."). `STRICT` (reduction order preserved) exists from the
/// release whose config takes `hcclDeterministic` 2 (8.5); the simulator
/// refuses it on an older one, where HCCL's config refuses the value too.
/// The communicator's `hcclDeterministic`, when it sets one, wins
/// (`docs/zh/user_guide/hccl_env/HCCL_DETERMINISTIC.md`, "use constraints").
pub fn deterministic() -> Result<bool, String> {
    let Some(v) = var("HCCL_DETERMINISTIC") else { return Ok(false) };
    let strict_ok = crate::version::CannVersion::current().max_deterministic() >= 2;
    match v.to_ascii_uppercase().as_str() {
        "FALSE" => Ok(false),
        "TRUE" => Ok(true),
        "STRICT" if strict_ok => Ok(true),
        _ => Err(format!(
            "HCCL_DETERMINISTIC={v:?} is incorrect (EI0001): the value should be true, false{}",
            if strict_ok { " or strict" } else { " (strict needs CANN 8.5)" }
        )),
    }
}

/// How long a rank waits for its peers to join a communicator or to set up a
/// collective's links: `HCCL_CONNECT_TIMEOUT` (default 120) plus 20 s.
///
/// hicann/hccl `docs/zh/user_guide/hccl_env/HCCL_CONNECT_TIMEOUT.md` (v9.1.0):
/// an integer in [120, 7200], default 120 s; "the actual wait is the value
/// plus 20 seconds". A value outside the range is refused.
pub fn connect_timeout() -> Result<Duration, String> {
    let secs = match var("HCCL_CONNECT_TIMEOUT") {
        None => 120,
        Some(v) => v
            .parse::<u64>()
            .ok()
            .filter(|s| (120..=7200).contains(s))
            .ok_or_else(|| format!("HCCL_CONNECT_TIMEOUT={v:?} is not an integer from 120 to 7200 (seconds)"))?,
    };
    Ok(Duration::from_secs(secs + 20))
}

/// Prints `msg` to stderr when `CANNSIM_TRACE=1`.
pub fn trace(msg: &str) {
    if get().trace {
        eprintln!("cann-sim: {msg}");
    }
}

static MALLOCS: AtomicU64 = AtomicU64::new(0);

/// Counts one successful device allocation; false, counting nothing, when
/// fault injection says it must fail. Call it only once the allocation can no
/// longer fail otherwise: the count is of successful allocations.
pub fn malloc_allowed() -> bool {
    match get().fail_malloc_after {
        None => true,
        Some(n) => MALLOCS.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |m| (m < n).then_some(m + 1)).is_ok(),
    }
}
