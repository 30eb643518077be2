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
//! | `HCCL_EXEC_TIMEOUT` | HCCL's own: seconds a collective waits for its peers on the device, unless the communicator's `HcclCommConfig` of version 8 or later sets `hcclExecTimeOut` (CANN 8.5 only); `0` never times out; 0 to 2147483647 with at most 2 decimals and 10 characters (read at `HcclGetRootInfo` and each communicator creation, see [`parse_exec_timeout`]) | 1836 |
//! | `HCCL_DFS_CONFIG` | HCCL's own: `inconsistent_check:on` makes `HcclGetCommAsyncError` report a later collective whose ranks disagree on its type, dtype, operation, root or count as `HCCL_E_PARA`, unless `cluster_heartbeat:off` (see [`inconsistent_check`]) | off |
//! | `HCCL_CONNECT_TIMEOUT` | HCCL's own: seconds, 120 to 7200, a rank waits for its peers to join a communicator or to set up a collective's links; the wait is this plus 20 s; digits only, at most 10 characters (see [`parse_connect_timeout`]) | 120 |

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

/// The value of one of HCCL's own variables as HCCL reads it: `None` when
/// unset, otherwise every byte, untrimmed, an empty value included (HCCL's
/// `GET_ENV`, hicann/hcomm v8.5.0 `src/platform/common/externalinput.cc:32-36`,
/// takes `mmSysGetEnv`, which is `getenv`, hicann/runtime v8.5.0
/// `src/mmpa/src/mmpa_linux_env.c:185-192`, and only a NULL is "unset").
fn hccl_var(name: &str) -> Option<Vec<u8>> {
    std::env::var_os(name).map(std::os::unix::ffi::OsStringExt::into_vec)
}

/// HCCL's longest numeric variable: `MAX_LEN_OF_DIGIT_ENV` (hicann/hcomm
/// v8.5.0 `src/platform/common/externalinput.h:20`), checked by `CheckEnvLen`
/// (`externalinput.cc:1023-1033`: a value of 11 or more bytes is refused).
pub const MAX_LEN_OF_DIGIT_ENV: usize = 10;

/// The largest `HCCL_EXEC_TIMEOUT` on a 910B or 910_93:
/// `HCCL_EXEC_TIME_OUT_S_910_93` = `NOTIFY_MAX_WAIT_TIME_910_93` =
/// 2147483647 s (hicann/hcomm v8.5.0 `src/platform/common/externalinput.h:28`,
/// `src/pub_inc/hccl_common.h:104`).
pub const MAX_EXEC_TIMEOUT_S: f64 = 2147483647.0;

/// The execution timeout of a communicator whose config sets no
/// `hcclExecTimeOut`: `HCCL_EXEC_TIMEOUT` seconds, else HCCL's default of
/// 1836 s (`None`: `0`, never time out). See [`parse_exec_timeout`].
pub fn exec_timeout() -> Result<Option<Duration>, String> {
    parse_exec_timeout(hccl_var("HCCL_EXEC_TIMEOUT").as_deref())
}

/// `HCCL_EXEC_TIMEOUT` (`raw`, `None` when unset) as HCCL 8.5.0 reads it on
/// a 910B. hicann/hcomm v8.5.0 `src/platform/common/externalinput.cc`:
/// `ParseExecTimeOut` (`:554-572`) refuses a value longer than
/// [`MAX_LEN_OF_DIGIT_ENV`] bytes (`:563-567`), then `SetHccLExecTimeOut`
/// (`:964-1021`) one that does not match `^\d+(\.\d{1,2})?$`
/// (`IsValidExecTimeOutMs`, `:543-552`: digits, optionally a point and one or
/// two digits; no sign, no space, not empty) and, on a 910B or 910_93, one
/// above [`MAX_EXEC_TIMEOUT_S`] (`:980-992`); each is HCCL_E_PARA. 0 never
/// times out (`:981`; hicann/hccl `docs/zh/user_guide/hccl_env/HCCL_EXEC_TIMEOUT.md`,
/// A2 default 1836 s, range [0, 2147483647]). The value, decimals included,
/// is the timeout (no rounding on a 910B: the multiple-of-68 rounding at
/// `:1009-1011` is for other chips).
pub fn parse_exec_timeout(raw: Option<&[u8]>) -> Result<Option<Duration>, String> {
    const DEFAULT: Duration = Duration::from_secs(1836);
    let Some(v) = raw else { return Ok(Some(DEFAULT)) };
    let refuse = |why: &str| {
        Err(format!(
            "HCCL_EXEC_TIMEOUT={:?} is invalid (EI0001): {why}; it should be a number greater than or equal to 0s \
             and less than or equal to 2147483647s",
            String::from_utf8_lossy(v)
        ))
    };
    if v.len() > MAX_LEN_OF_DIGIT_ENV {
        return refuse(&format!("longer than {MAX_LEN_OF_DIGIT_ENV} characters"));
    }
    let (int, frac) = match v.iter().position(|&b| b == b'.') {
        Some(i) => (&v[..i], Some(&v[i + 1..])),
        None => (v, None),
    };
    let digits = |d: &[u8]| d.iter().all(u8::is_ascii_digit);
    let frac_ok = match frac {
        None => true,
        Some(f) => (1..=2).contains(&f.len()) && digits(f),
    };
    if int.is_empty() || !digits(int) || !frac_ok {
        return refuse("not digits with at most 2 decimals");
    }
    // Only ASCII digits and one point: a valid f64.
    let secs: f64 = std::str::from_utf8(v).ok().and_then(|t| t.parse().ok()).unwrap_or(f64::INFINITY);
    if secs > MAX_EXEC_TIMEOUT_S {
        return refuse("above 2147483647");
    }
    Ok((secs > 0.0).then(|| Duration::from_secs_f64(secs)))
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
/// The value is taken untrimmed, and set but empty is a value (`hccl_var`;
/// hicann/hcomm v8.5.0 `src/platform/common/externalinput.cc:617-650`, the
/// same parse in `InitExternalInput`): `""` and `" true"` are refused.
pub fn deterministic() -> Result<bool, String> {
    let Some(v) = hccl_var("HCCL_DETERMINISTIC") else { return Ok(false) };
    let v = String::from_utf8_lossy(&v);
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
/// collective's links: `HCCL_CONNECT_TIMEOUT` (default 120) plus 20 s. See
/// [`parse_connect_timeout`].
pub fn connect_timeout() -> Result<Duration, String> {
    parse_connect_timeout(hccl_var("HCCL_CONNECT_TIMEOUT").as_deref())
}

/// `HCCL_CONNECT_TIMEOUT` (`raw`, `None` when unset) as HCCL 8.5.0 reads it,
/// plus 20 s. hicann/hcomm v8.5.0 `src/platform/common/externalinput.cc:574-603`
/// (`ParseLinkConnTimeOut`): a value longer than [`MAX_LEN_OF_DIGIT_ENV`]
/// bytes is refused (`:581-584`), then one with a character other than a
/// digit after an optional leading `-` (`IsAllDigit`, `src/platform/common/sal.cc:563-581`:
/// so `+300` and ` 300` are refused), then one `std::stoi` cannot read (the
/// empty value, `-`) or outside [120, 7200] (`:587-595`,
/// `HCCL_MIN_LINK_TIME_OUT_S`/`HCCL_MAX_LINK_TIME_OUT_S`, `externalinput.h:24-25`),
/// each HCCL_E_PARA (EI0001, `:76-82`). hicann/hccl
/// `docs/zh/user_guide/hccl_env/HCCL_CONNECT_TIMEOUT.md`: "the actual wait is
/// the value plus 20 seconds".
pub fn parse_connect_timeout(raw: Option<&[u8]>) -> Result<Duration, String> {
    let Some(v) = raw else { return Ok(Duration::from_secs(120 + 20)) };
    let refuse = |why: &str| {
        Err(format!(
            "HCCL_CONNECT_TIMEOUT={:?} is invalid (EI0001): {why}; it should be a number greater than or equal to \
             120s and less than or equal to 7200s",
            String::from_utf8_lossy(v)
        ))
    };
    if v.len() > MAX_LEN_OF_DIGIT_ENV {
        return refuse(&format!("longer than {MAX_LEN_OF_DIGIT_ENV} characters"));
    }
    let unsigned = v.strip_prefix(b"-").unwrap_or(v);
    if !unsigned.iter().all(u8::is_ascii_digit) {
        return refuse("not all digits");
    }
    let secs = std::str::from_utf8(v).ok().and_then(|t| t.parse::<i32>().ok());
    match secs.filter(|s| (120..=7200).contains(s)) {
        Some(s) => Ok(Duration::from_secs(s as u64 + 20)),
        None => refuse("not an integer from 120 to 7200"),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn exec(v: &str) -> Result<Option<Duration>, String> {
        parse_exec_timeout(Some(v.as_bytes()))
    }

    fn connect(v: &str) -> Result<Duration, String> {
        parse_connect_timeout(Some(v.as_bytes()))
    }

    #[test]
    fn exec_timeout_takes_at_most_ten_digits_and_two_decimals_up_to_i32_max() {
        assert_eq!(parse_exec_timeout(None), Ok(Some(Duration::from_secs(1836))));
        assert_eq!(exec("0"), Ok(None));
        assert_eq!(exec("0.00"), Ok(None));
        assert_eq!(exec("0000000300"), Ok(Some(Duration::from_secs(300))));
        assert_eq!(exec("2147483647"), Ok(Some(Duration::from_secs(2147483647))));
        assert_eq!(exec("1.5"), Ok(Some(Duration::from_millis(1500))));
        assert_eq!(exec("9999999.25"), Ok(Some(Duration::from_secs_f64(9999999.25))));
        for bad in [
            "00000000300",
            "2147483648",
            "9999999999",
            "99999999.25",
            "+300",
            "-1",
            "abc",
            "1.234",
            "1.",
            ".5",
            "1e3",
            " 300",
            "300 ",
            "",
            "1,5",
        ] {
            assert!(exec(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn connect_timeout_takes_at_most_ten_digits_from_120_to_7200() {
        assert_eq!(parse_connect_timeout(None), Ok(Duration::from_secs(140)));
        assert_eq!(connect("120"), Ok(Duration::from_secs(140)));
        assert_eq!(connect("7200"), Ok(Duration::from_secs(7220)));
        assert_eq!(connect("0000000120"), Ok(Duration::from_secs(140)));
        for bad in [
            "00000000120",
            "119",
            "7201",
            "0",
            "2147483647",
            "2147483648",
            "+300",
            "-300",
            "-",
            "300s",
            " 300",
            "300 ",
            "",
            "300.0",
        ] {
            assert!(connect(bad).is_err(), "{bad:?}");
        }
    }
}
