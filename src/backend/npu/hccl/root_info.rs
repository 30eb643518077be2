//! The root info every rank needs to join a communicator, as bytes and hex.

use hccl_sys::HcclRootInfo as RawRootInfo;

use crate::{Error, Result};

use super::api::ROOT_INFO_BYTES;

/// The 4108 opaque bytes rank 0 creates and every rank needs to join a
/// communicator. Plain bytes: send them out of band in any form
/// ([`HcclRootInfo::to_hex`] / [`HcclRootInfo::from_hex`] for text channels).
#[derive(Clone, PartialEq, Eq)]
pub struct HcclRootInfo {
    bytes: Box<[u8; ROOT_INFO_BYTES]>,
}

impl std::fmt::Debug for HcclRootInfo {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HcclRootInfo({}..)", &self.to_hex()[..16])
    }
}

impl HcclRootInfo {
    pub(super) fn from_raw(raw: &RawRootInfo) -> Self {
        let mut bytes = Box::new([0u8; ROOT_INFO_BYTES]);
        for (b, c) in bytes.iter_mut().zip(raw.internal.iter()) {
            *b = *c as u8;
        }
        HcclRootInfo { bytes }
    }

    pub(super) fn to_raw(&self) -> RawRootInfo {
        let mut raw = RawRootInfo::default();
        for (c, b) in raw.internal.iter_mut().zip(self.bytes.iter()) {
            *c = *b as _;
        }
        raw
    }

    /// The raw bytes.
    pub fn as_bytes(&self) -> &[u8; ROOT_INFO_BYTES] {
        &self.bytes
    }

    /// From raw bytes; exactly [`ROOT_INFO_BYTES`] long.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self> {
        let arr: [u8; ROOT_INFO_BYTES] = bytes.try_into().map_err(|_| {
            Error::invalid(
                "HcclRootInfo::from_bytes",
                "bytes",
                format!("{} bytes, expected {ROOT_INFO_BYTES}", bytes.len()),
            )
        })?;
        Ok(HcclRootInfo { bytes: Box::new(arr) })
    }

    /// Lower-case hex, 8216 characters.
    pub fn to_hex(&self) -> String {
        const DIGITS: &[u8; 16] = b"0123456789abcdef";
        let mut s = String::with_capacity(ROOT_INFO_BYTES * 2);
        for b in self.bytes.iter() {
            s.push(DIGITS[(b >> 4) as usize] as char);
            s.push(DIGITS[(b & 15) as usize] as char);
        }
        s
    }

    /// Parses [`HcclRootInfo::to_hex`]'s output (either case; surrounding
    /// whitespace ignored).
    pub fn from_hex(hex: &str) -> Result<Self> {
        const OP: &str = "HcclRootInfo::from_hex";
        let hex = hex.trim().as_bytes();
        if hex.len() != ROOT_INFO_BYTES * 2 {
            return Err(Error::invalid(
                OP,
                "hex",
                format!("{} characters, expected {}", hex.len(), ROOT_INFO_BYTES * 2),
            ));
        }
        let digit = |pos: usize| -> Result<u8> {
            let c = hex[pos];
            (c as char).to_digit(16).map(|d| d as u8).ok_or_else(|| {
                Error::invalid(OP, "hex", format!("character {:?} at {pos} is not a hex digit", c as char))
            })
        };
        let mut bytes = Box::new([0u8; ROOT_INFO_BYTES]);
        for (i, b) in bytes.iter_mut().enumerate() {
            *b = (digit(2 * i)? << 4) | digit(2 * i + 1)?;
        }
        Ok(HcclRootInfo { bytes })
    }
}
