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
