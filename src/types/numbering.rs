//! Enums whose numbers the C ABI and Python share, each number written once:
//! [`Numbered`], [`Variant`] and the `numbered!` macro that defines them.

use std::ffi::CStr;

/// One variant of a [`Numbered`] enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Variant {
    /// Upper-case name, the C ABI's spelling without the enum's prefix
    /// (`"BF16"`, `"FUSED_MC2"`); the Python package's member name.
    pub name: &'static str,
    /// [`Variant::name`] NUL-terminated, for the C ABI's name tables.
    pub c_name: &'static CStr,
    /// The fixed number.
    pub value: u32,
    /// The variant's doc comment, one line per doc line.
    pub doc: &'static str,
}

impl Variant {
    /// `name` NUL-terminated, checked at compile time where `numbered!`
    /// builds its table (a name holding a NUL fails the build).
    pub const fn nul_terminated(name_with_nul: &'static str) -> &'static CStr {
        match CStr::from_bytes_with_nul(name_with_nul.as_bytes()) {
            Ok(c) => c,
            Err(_) => panic!("a numbered variant's name must end in its only NUL"),
        }
    }
}

/// A number that is no variant of a [`Numbered`] enum.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UnknownValue {
    /// The enum's Rust name.
    pub type_name: &'static str,
    /// The number.
    pub value: u32,
}

impl std::fmt::Display for UnknownValue {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} is not a {} number", self.value, self.type_name)
    }
}

impl std::error::Error for UnknownValue {}

/// An enum whose variants have fixed numbers that the C ABI
/// (`include/ascend_moe.h`) and the Python package take from it. Defined
/// with the crate's `numbered!` macro, which writes each number once: the
/// discriminant, [`TryFrom<u32>`] and [`Numbered::TABLE`] all come from it.
pub trait Numbered: Copy + Eq + TryFrom<u32, Error = UnknownValue> + 'static {
    /// The enum's Rust name.
    const NAME: &'static str;
    /// Name, number and doc of every variant, in declaration order.
    const TABLE: &'static [Variant];

    /// The variant's number (its discriminant).
    fn value(self) -> u32;

    /// The variant's entry of [`Numbered::TABLE`].
    fn variant(self) -> &'static Variant;

    /// The valid numbers, for error messages: `0..=3`, or a list when they
    /// are not dense from 0.
    fn expected() -> String {
        let n = Self::TABLE.len() as u32;
        if Self::TABLE.iter().enumerate().all(|(i, e)| e.value == i as u32) {
            return format!("0..={}", n.saturating_sub(1));
        }
        Self::TABLE.iter().map(|e| e.value.to_string()).collect::<Vec<_>>().join(", ")
    }
}

/// Defines a `#[repr(u32)]` enum whose numbers are written once, as
/// `Variant = number => "UPPER_NAME"`, and derives from them the
/// discriminants, `VARIANTS` (every variant, in order), [`TryFrom<u32>`] and
/// [`Numbered`] (its table of names, numbers and docs).
///
/// A number used twice is a compile error (the discriminants collide).
macro_rules! numbered {
    (@entry $upper:literal, $value:literal, [$($doc:literal)*]) => {
        $crate::types::Variant {
            name: $upper,
            c_name: $crate::types::Variant::nul_terminated(concat!($upper, "\0")),
            value: $value,
            doc: concat!($($doc, "\n"),*),
        }
    };
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $(
                $(#[doc = $doc:literal])*
                $variant:ident = $value:literal => $upper:literal
            ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        #[repr(u32)]
        $vis enum $name {
            $( $(#[doc = $doc])* $variant = $value, )+
        }

        impl $name {
            /// Every variant, in numbering order.
            pub const VARIANTS: [$name; [$(stringify!($variant)),+].len()] = [$($name::$variant),+];
        }

        impl TryFrom<u32> for $name {
            type Error = $crate::types::UnknownValue;
            fn try_from(v: u32) -> Result<Self, Self::Error> {
                match v {
                    $($value => Ok($name::$variant),)+
                    _ => Err($crate::types::UnknownValue { type_name: stringify!($name), value: v }),
                }
            }
        }

        impl $crate::types::Numbered for $name {
            const NAME: &'static str = stringify!($name);
            const TABLE: &'static [$crate::types::Variant] =
                &[$($crate::types::numbered!(@entry $upper, $value, [$($doc)*])),+];
            fn value(self) -> u32 {
                self as u32
            }
            fn variant(self) -> &'static $crate::types::Variant {
                match self {
                    $($name::$variant => {
                        const V: $crate::types::Variant = $crate::types::numbered!(@entry $upper, $value, [$($doc)*]);
                        &V
                    })+
                }
            }
        }
    };
}
pub(crate) use numbered;
