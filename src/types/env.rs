//! Settings read from the environment.

/// The environment variable `var`: `Ok(None)` when unset, `parse` of its
/// value when that gives one, else `Err` with the value as set (a setting
/// the caller ignores, and can name).
pub(crate) fn env_setting<T>(var: &str, parse: impl FnOnce(&str) -> Option<T>) -> Result<Option<T>, String> {
    match std::env::var(var) {
        Err(std::env::VarError::NotPresent) => Ok(None),
        Err(std::env::VarError::NotUnicode(v)) => Err(v.to_string_lossy().into_owned()),
        Ok(s) => parse(&s).map(Some).ok_or(s),
    }
}

/// An on/off switch: `Some(true)` for `1`, `Some(false)` for `0` (space
/// around it ignored), `None` when unset. Any other value is `None` as well,
/// and is warned about on stderr, once per variable and process, naming the
/// values the switch takes: a check someone meant to turn on (`=true`,
/// `=yes`) must not stay off without a word.
pub(crate) fn env_switch(var: &'static str) -> Option<bool> {
    match env_setting(var, parse_switch) {
        Ok(v) => v,
        Err(v) => {
            static WARNED: std::sync::Mutex<Vec<&str>> = std::sync::Mutex::new(Vec::new());
            let mut warned = WARNED.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if !warned.contains(&var) {
                warned.push(var);
                eprintln!("{}", ignored_switch(var, &v));
            }
            None
        }
    }
}

/// `1` or `0`, with space around it.
fn parse_switch(s: &str) -> Option<bool> {
    match s.trim() {
        "1" => Some(true),
        "0" => Some(false),
        _ => None,
    }
}

/// The warning of a switch set to `value`, which is neither `1` nor `0`.
fn ignored_switch(var: &str, value: &str) -> String {
    format!("ascend-moe: warning: {var}={value:?} is ignored: set it to 1 (on) or 0 (off); it is taken as unset")
}

/// The reading `env_switch` makes of `var`, without its warning, for reports:
/// `Ok(None)` unset, `Ok(Some(on))`, or `Err` with a value it ignores.
pub fn env_switch_setting(var: &str) -> Result<Option<bool>, String> {
    env_setting(var, parse_switch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn switches_take_one_and_zero_and_name_what_they_ignore() {
        assert_eq!(parse_switch(" 1 "), Some(true));
        assert_eq!(parse_switch("0"), Some(false));
        for v in ["true", "yes", "on", "2", ""] {
            assert_eq!(parse_switch(v), None, "{v:?}");
        }
        let w = ignored_switch("ASCEND_MOE_CHECK_LAYOUT", "true");
        assert!(w.contains("ASCEND_MOE_CHECK_LAYOUT=\"true\"") && w.contains("1 (on) or 0 (off)"), "{w}");
    }
}
