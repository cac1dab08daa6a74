//! Endpoint names in libfabric's `FI_SOCKADDR_IN` / `FI_SOCKADDR_IN6` formats, and the
//! `addrlen` rules of `fi_getname` / `fi_getpeer` (fi_cm(3)).

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};

use crate::core::error::{errno, Error, Result};

const AF_INET: u16 = 2;
const AF_INET6: u16 = 10;
/// `sizeof(struct sockaddr_in)` and `sizeof(struct sockaddr_in6)`.
pub const SOCKADDR_IN_LEN: usize = 16;
pub const SOCKADDR_IN6_LEN: usize = 28;

/// The C `struct sockaddr_in` / `sockaddr_in6` bytes of `a` (family in host order, port
/// and address in network order), as `fi_getname` returns them.
pub fn sockaddr_bytes(a: &SocketAddr) -> Vec<u8> {
    match a {
        SocketAddr::V4(v) => {
            let mut b = vec![0u8; SOCKADDR_IN_LEN];
            b[0..2].copy_from_slice(&AF_INET.to_ne_bytes());
            b[2..4].copy_from_slice(&v.port().to_be_bytes());
            b[4..8].copy_from_slice(&v.ip().octets());
            b
        }
        SocketAddr::V6(v) => {
            let mut b = vec![0u8; SOCKADDR_IN6_LEN];
            b[0..2].copy_from_slice(&AF_INET6.to_ne_bytes());
            b[2..4].copy_from_slice(&v.port().to_be_bytes());
            b[4..8].copy_from_slice(&v.flowinfo().to_be_bytes());
            b[8..24].copy_from_slice(&v.ip().octets());
            b[24..28].copy_from_slice(&v.scope_id().to_ne_bytes());
            b
        }
    }
}

/// Parses the bytes of a `struct sockaddr_in` / `sockaddr_in6` (`fi_setname`, `fi_connect`).
pub fn parse_sockaddr(b: &[u8]) -> Result<SocketAddr> {
    let bad = |why: &str| Error::new(errno::EINVAL, format!("not a socket address: {why}"));
    if b.len() < 2 {
        return Err(bad("shorter than its family field"));
    }
    let u16_at = |i: usize| [b[i], b[i + 1]];
    let u32_at = |i: usize| [b[i], b[i + 1], b[i + 2], b[i + 3]];
    match u16::from_ne_bytes(u16_at(0)) {
        AF_INET if b.len() >= SOCKADDR_IN_LEN => Ok(SocketAddr::V4(SocketAddrV4::new(
            Ipv4Addr::from(u32_at(4)),
            u16::from_be_bytes(u16_at(2)),
        ))),
        AF_INET6 if b.len() >= SOCKADDR_IN6_LEN => {
            let mut ip = [0u8; 16];
            ip.copy_from_slice(&b[8..24]);
            Ok(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(ip),
                u16::from_be_bytes(u16_at(2)),
                u32::from_be_bytes(u32_at(4)),
                u32::from_ne_bytes(u32_at(24)),
            )))
        }
        AF_INET | AF_INET6 => Err(bad(&format!("{} bytes are too few", b.len()))),
        f => Err(bad(&format!(
            "address family {f} is not AF_INET or AF_INET6"
        ))),
    }
}

/// fi_cm(3)'s rule for returning a name into a caller's buffer: copy what fits, set
/// `addrlen` to the full size, and fail with `-FI_ETOOSMALL` when the buffer was smaller.
pub fn fill_name(name: &[u8], buf: &mut [u8], addrlen: &mut usize) -> Result<()> {
    let avail = (*addrlen).min(buf.len());
    let n = avail.min(name.len());
    buf[..n].copy_from_slice(&name[..n]);
    *addrlen = name.len();
    if avail < name.len() {
        return Err(Error::new(
            errno::ETOOSMALL,
            format!(
                "the address needs {} bytes, the buffer has {avail}",
                name.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sockaddrs_round_trip_in_both_families() {
        for a in ["192.0.2.1:7471", "[fe80::1%3]:18515", "0.0.0.0:0"] {
            let a: SocketAddr = a.parse().unwrap();
            let b = sockaddr_bytes(&a);
            assert_eq!(parse_sockaddr(&b).unwrap(), a);
        }
        let b = sockaddr_bytes(&"10.1.2.3:258".parse().unwrap());
        assert_eq!(
            &b[2..8],
            &[1, 2, 10, 1, 2, 3],
            "port and address in network order"
        );
    }

    #[test]
    fn malformed_sockaddrs_are_einval() {
        assert_eq!(parse_sockaddr(&[]).unwrap_err().errno(), errno::EINVAL);
        let v4 = sockaddr_bytes(&"10.0.0.1:1".parse().unwrap());
        assert_eq!(parse_sockaddr(&v4[..8]).unwrap_err().errno(), errno::EINVAL);
        let mut other = v4.clone();
        other[0..2].copy_from_slice(&1u16.to_ne_bytes());
        assert_eq!(parse_sockaddr(&other).unwrap_err().errno(), errno::EINVAL);
    }

    #[test]
    fn fill_name_truncates_reports_the_size_and_says_etoosmall() {
        let name = [1u8, 2, 3, 4, 5, 6];
        let mut buf = [0u8; 8];
        let mut len = 4;
        let e = fill_name(&name, &mut buf, &mut len).unwrap_err();
        assert_eq!(
            (e.errno(), len, &buf[..5]),
            (errno::ETOOSMALL, 6, &[1, 2, 3, 4, 0][..])
        );
        let mut len = 8;
        fill_name(&name, &mut buf, &mut len).unwrap();
        assert_eq!((len, &buf[..6]), (6, &name[..]));
        let mut len = 0;
        assert!(fill_name(&name, &mut buf, &mut len).is_err());
        assert_eq!(len, 6, "a zero-length query learns the size");
    }
}
