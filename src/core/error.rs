//! One error type carrying a libfabric errno, a provider errno and the cause in words.

use std::borrow::Cow;
use std::fmt;

use rfabric_sys::fabric as fi;

/// libfabric's errno values, positive, as `fi_errno.h` defines them.
pub mod errno {
    use super::fi;
    pub const EPERM: i32 = fi::FI_EPERM;
    pub const ENOENT: i32 = fi::FI_ENOENT;
    pub const EIO: i32 = fi::FI_EIO;
    pub const EAGAIN: i32 = fi::FI_EAGAIN;
    pub const ENOMEM: i32 = fi::FI_ENOMEM;
    pub const EMFILE: i32 = fi::FI_EMFILE;
    pub const EACCES: i32 = fi::FI_EACCES;
    pub const EBUSY: i32 = fi::FI_EBUSY;
    pub const ENODEV: i32 = fi::FI_ENODEV;
    pub const EINVAL: i32 = fi::FI_EINVAL;
    pub const ENOSPC: i32 = fi::FI_ENOSPC;
    pub const ENOSYS: i32 = fi::FI_ENOSYS;
    pub const ENODATA: i32 = fi::FI_ENODATA;
    pub const EMSGSIZE: i32 = fi::FI_EMSGSIZE;
    pub const EOPNOTSUPP: i32 = fi::FI_EOPNOTSUPP;
    pub const ENOPROTOOPT: i32 = fi::FI_ENOPROTOOPT;
    pub const EADDRINUSE: i32 = fi::FI_EADDRINUSE;
    pub const EADDRNOTAVAIL: i32 = fi::FI_EADDRNOTAVAIL;
    pub const ENETDOWN: i32 = fi::FI_ENETDOWN;
    pub const ENETUNREACH: i32 = fi::FI_ENETUNREACH;
    pub const ECONNABORTED: i32 = fi::FI_ECONNABORTED;
    pub const ECONNRESET: i32 = fi::FI_ECONNRESET;
    pub const EISCONN: i32 = fi::FI_EISCONN;
    pub const ENOTCONN: i32 = fi::FI_ENOTCONN;
    pub const ESHUTDOWN: i32 = fi::FI_ESHUTDOWN;
    pub const ETIMEDOUT: i32 = fi::FI_ETIMEDOUT;
    pub const ECONNREFUSED: i32 = fi::FI_ECONNREFUSED;
    pub const EHOSTUNREACH: i32 = fi::FI_EHOSTUNREACH;
    pub const EALREADY: i32 = fi::FI_EALREADY;
    pub const ECANCELED: i32 = fi::FI_ECANCELED;
    pub const ENOMSG: i32 = fi::FI_ENOMSG;
    pub const EOTHER: i32 = fi::FI_EOTHER as i32;
    pub const ETOOSMALL: i32 = fi::FI_ETOOSMALL as i32;
    pub const EOPBADSTATE: i32 = fi::FI_EOPBADSTATE as i32;
    pub const EAVAIL: i32 = fi::FI_EAVAIL as i32;
    pub const EBADFLAGS: i32 = fi::FI_EBADFLAGS as i32;
    pub const ENOEQ: i32 = fi::FI_ENOEQ as i32;
    pub const ENOCQ: i32 = fi::FI_ENOCQ as i32;
    pub const ENOAV: i32 = fi::FI_ENOAV as i32;
    pub const ETRUNC: i32 = fi::FI_ETRUNC as i32;
    pub const EOVERRUN: i32 = fi::FI_EOVERRUN as i32;
}

/// The text `fi_strerror` gives for a libfabric errno.
pub fn strerror(errnum: i32) -> Cow<'static, str> {
    use errno::*;
    let s = match errnum {
        EOTHER => "Unspecified error",
        ETOOSMALL => "Provided buffer is too small",
        EOPBADSTATE => "Operation not permitted in current state",
        EAVAIL => "Error available",
        EBADFLAGS => "Flags not supported",
        ENOEQ => "Missing or unavailable event queue",
        ENOCQ => "Missing or unavailable completion queue",
        ENOAV => "Missing or unavailable address vector",
        ETRUNC => "Truncation error",
        EOVERRUN => "Queue has been overrun",
        e if (1..256).contains(&e) => {
            let s = std::io::Error::from_raw_os_error(e).to_string();
            // std appends " (os error N)"; fi_strerror gives the bare text.
            return match s.find(" (os error") {
                Some(i) => s[..i].to_string().into(),
                None => s.into(),
            };
        }
        _ => "Unknown error",
    };
    s.into()
}

/// A failed call: what went wrong in words, the libfabric errno and the provider's own.
#[derive(Clone, PartialEq, Eq)]
pub struct Error {
    errno: i32,
    prov_errno: i32,
    cause: Cow<'static, str>,
}

/// Results of rfabric calls.
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// An error with its libfabric errno (positive) and the cause, naming the fix where known.
    pub fn new(errno: i32, cause: impl Into<Cow<'static, str>>) -> Self {
        Error {
            errno: errno.abs(),
            prov_errno: 0,
            cause: cause.into(),
        }
    }

    /// Adds the provider-specific errno (an OS errno or an `ibv_wc_status`).
    pub fn with_prov_errno(mut self, prov_errno: i32) -> Self {
        self.prov_errno = prov_errno;
        self
    }

    /// An error from an OS or verbs call that returned `os_errno`.
    pub fn os(os_errno: i32, what: impl Into<Cow<'static, str>>) -> Self {
        let what = what.into();
        let e = os_errno.abs();
        Error {
            errno: e,
            prov_errno: e,
            cause: format!("{what}: {}", std::io::Error::from_raw_os_error(e)).into(),
        }
    }

    /// The libfabric errno, positive (the C ABI returns its negation).
    pub fn errno(&self) -> i32 {
        self.errno
    }

    pub fn prov_errno(&self) -> i32 {
        self.prov_errno
    }

    /// Whether the cause is static text (no allocation was made for it).
    pub fn cause_is_static(&self) -> bool {
        matches!(self.cause, Cow::Borrowed(_))
    }

    pub fn cause(&self) -> &str {
        &self.cause
    }

    /// `-errno`, as the C ABI returns it.
    pub fn to_neg(&self) -> isize {
        -(self.errno as isize)
    }

    pub fn is_again(&self) -> bool {
        self.errno == errno::EAGAIN
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({})", self.cause, strerror(self.errno))
    }
}

impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Error {{ errno: {}, prov_errno: {}, cause: {:?} }}",
            self.errno, self.prov_errno, self.cause
        )
    }
}

impl std::error::Error for Error {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn display_names_the_cause_and_the_errno_text() {
        let e = Error::new(-errno::ENODATA, "no RDMA device found: load rdma_rxe");
        assert_eq!(e.errno(), errno::ENODATA);
        assert_eq!(e.to_neg(), -(errno::ENODATA as isize));
        assert_eq!(
            e.to_string(),
            "no RDMA device found: load rdma_rxe (No data available)"
        );
    }

    #[test]
    fn os_errors_keep_the_os_errno_as_provider_errno() {
        let e = Error::os(libc::ENOMEM, "ibv_alloc_pd");
        assert_eq!((e.errno(), e.prov_errno()), (errno::ENOMEM, libc::ENOMEM));
        assert!(e.cause().starts_with("ibv_alloc_pd: "));
    }

    #[test]
    fn libfabric_specific_errnos_have_their_own_text() {
        assert_eq!(strerror(errno::ETOOSMALL), "Provided buffer is too small");
        assert_eq!(strerror(errno::EAVAIL), "Error available");
        assert_eq!(strerror(100_000), "Unknown error");
    }
}
