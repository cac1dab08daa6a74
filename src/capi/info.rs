//! `struct fi_info` in C, both ways. Infos handed to libfabric's core are allocated the way
//! `fi_freeinfo` frees them: every part with `calloc`, strings with `strdup`, addresses with
//! `malloc`; `fabric_attr->prov_name` is left NULL for the core to fill.

use std::ffi::{c_char, CStr};
use std::ptr;

use rfabric_sys::fabric as fi;

use crate::core::addr::{parse_sockaddr, sockaddr_bytes};
use crate::core::error::{errno, Error, Result};
use crate::core::flags::*;
use crate::core::info::*;

/// A zeroed C object of type `T` from `calloc`, or `ENOMEM`.
fn calloc<T>() -> Result<*mut T> {
    // SAFETY: calloc returns NULL or zeroed memory for one T; every C struct here is plain
    // data for which all-zero is valid.
    let p = unsafe { libc::calloc(1, std::mem::size_of::<T>()) }.cast::<T>();
    if p.is_null() {
        return Err(Error::new(errno::ENOMEM, "out of memory for an fi_info"));
    }
    Ok(p)
}

/// A `strdup` of `s` (NULL for an empty string), or `ENOMEM`.
fn strdup(s: &str) -> Result<*mut c_char> {
    if s.is_empty() {
        return Ok(ptr::null_mut());
    }
    let c = std::ffi::CString::new(s)
        .map_err(|_| Error::new(errno::EINVAL, format!("{s:?} holds a NUL byte")))?;
    // SAFETY: c is a valid NUL-terminated string; strdup copies it into malloc'd memory.
    let p = unsafe { libc::strdup(c.as_ptr()) };
    if p.is_null() {
        return Err(Error::new(errno::ENOMEM, "out of memory for a name"));
    }
    Ok(p)
}

/// A `malloc`'d copy of an address, with its length.
fn addr_copy(a: &Option<std::net::SocketAddr>) -> Result<(*mut libc::c_void, usize)> {
    let Some(a) = a else {
        return Ok((ptr::null_mut(), 0));
    };
    bytes_copy(&sockaddr_bytes(a))
}

/// A `malloc`ed copy of `b` (libfabric's core frees it with the info).
fn bytes_copy(b: &[u8]) -> Result<(*mut libc::c_void, usize)> {
    // SAFETY: malloc returns NULL or b.len() writable bytes.
    let p = unsafe { libc::malloc(b.len()) };
    if p.is_null() {
        return Err(Error::new(errno::ENOMEM, "out of memory for an address"));
    }
    // SAFETY: p has b.len() bytes; b does not overlap fresh memory.
    unsafe { ptr::copy_nonoverlapping(b.as_ptr(), p.cast::<u8>(), b.len()) };
    Ok((p, b.len()))
}

/// One `fi_info` for `i` (with `next` NULL). On failure nothing is leaked.
pub fn to_c(i: &Info) -> Result<*mut fi::fi_info> {
    let p = calloc::<fi::fi_info>()?;
    // SAFETY: p is a fresh zeroed fi_info: on failure fi_freeinfo frees what was set so far
    // (it skips NULL parts), which is what libfabric's core would do with it.
    match unsafe { fill(p, i) } {
        Ok(()) => Ok(p),
        Err(e) => {
            // SAFETY: p and its parts were allocated as fi_freeinfo expects.
            unsafe { fi::fi_freeinfo(p) };
            Err(e)
        }
    }
}

/// A list of `fi_info`s linked through `next`, or NULL for none.
pub fn list_to_c(infos: &[Info]) -> Result<*mut fi::fi_info> {
    let mut head: *mut fi::fi_info = ptr::null_mut();
    for i in infos.iter().rev() {
        let p = match to_c(i) {
            Ok(p) => p,
            Err(e) => {
                // SAFETY: head is NULL or a list built here, freed as the core would.
                unsafe { fi::fi_freeinfo(head) };
                return Err(e);
            }
        };
        // SAFETY: p is a fresh fi_info of ours.
        unsafe { (*p).next = head };
        head = p;
    }
    Ok(head)
}

/// # Safety
/// `p` is a zeroed `fi_info` allocated with `calloc`.
unsafe fn fill(p: *mut fi::fi_info, i: &Info) -> Result<()> {
    // SAFETY: the caller's contract; every pointer set below is a fresh allocation.
    unsafe {
        let o = &mut *p;
        o.caps = i.caps.bits();
        o.mode = i.mode.bits();
        o.addr_format = i.addr_format.raw();
        (o.src_addr, o.src_addrlen) = addr_copy(&i.src_addr)?;
        (o.dest_addr, o.dest_addrlen) = match &i.dest_name {
            Some(n) => bytes_copy(n)?,
            None => addr_copy(&i.dest_addr)?,
        };

        o.tx_attr = calloc()?;
        let t = &mut *o.tx_attr;
        t.caps = i.tx_attr.caps.bits();
        t.mode = i.tx_attr.mode.bits();
        t.op_flags = i.tx_attr.op_flags.bits();
        t.msg_order = i.tx_attr.msg_order;
        t.comp_order = i.tx_attr.comp_order;
        t.inject_size = i.tx_attr.inject_size;
        t.size = i.tx_attr.size;
        t.iov_limit = i.tx_attr.iov_limit;
        t.rma_iov_limit = i.tx_attr.rma_iov_limit;

        o.rx_attr = calloc()?;
        let r = &mut *o.rx_attr;
        r.caps = i.rx_attr.caps.bits();
        r.mode = i.rx_attr.mode.bits();
        r.op_flags = i.rx_attr.op_flags.bits();
        r.msg_order = i.rx_attr.msg_order;
        r.comp_order = i.rx_attr.comp_order;
        r.total_buffered_recv = i.rx_attr.total_buffered_recv;
        r.size = i.rx_attr.size;
        r.iov_limit = i.rx_attr.iov_limit;

        o.ep_attr = calloc()?;
        let e = &mut *o.ep_attr;
        e.type_ = i.ep_attr.ep_type.raw();
        e.protocol = i.ep_attr.protocol;
        e.protocol_version = i.ep_attr.protocol_version;
        e.max_msg_size = i.ep_attr.max_msg_size;
        e.msg_prefix_size = i.ep_attr.msg_prefix_size;
        e.max_order_raw_size = i.ep_attr.max_order_raw_size;
        e.max_order_war_size = i.ep_attr.max_order_war_size;
        e.max_order_waw_size = i.ep_attr.max_order_waw_size;
        e.mem_tag_format = i.ep_attr.mem_tag_format;
        e.tx_ctx_cnt = i.ep_attr.tx_ctx_cnt;
        e.rx_ctx_cnt = i.ep_attr.rx_ctx_cnt;

        o.domain_attr = calloc()?;
        let d = &mut *o.domain_attr;
        let a = &i.domain_attr;
        d.name = strdup(&a.name)?;
        d.threading = a.threading.raw();
        d.control_progress = a.control_progress.raw();
        d.data_progress = a.data_progress.raw();
        d.resource_mgmt = a.resource_mgmt.raw();
        d.av_type = a.av_type.raw();
        d.mr_mode = a.mr_mode.bits() as i32;
        d.mr_key_size = a.mr_key_size;
        d.cq_data_size = a.cq_data_size;
        d.cq_cnt = a.cq_cnt;
        d.ep_cnt = a.ep_cnt;
        d.tx_ctx_cnt = a.tx_ctx_cnt;
        d.rx_ctx_cnt = a.rx_ctx_cnt;
        d.max_ep_tx_ctx = a.max_ep_tx_ctx;
        d.max_ep_rx_ctx = a.max_ep_rx_ctx;
        d.max_ep_stx_ctx = a.max_ep_stx_ctx;
        d.max_ep_srx_ctx = a.max_ep_srx_ctx;
        d.cntr_cnt = a.cntr_cnt;
        d.mr_iov_limit = a.mr_iov_limit;
        d.caps = a.caps.bits();
        d.mode = a.mode.bits();
        d.max_err_data = a.max_err_data;
        d.mr_cnt = a.mr_cnt;

        o.fabric_attr = calloc()?;
        let f = &mut *o.fabric_attr;
        f.name = strdup(&i.fabric_attr.name)?;
        // prov_name stays NULL: the core fills in the name it loaded the provider under.
        f.prov_version = i.fabric_attr.prov_version;
        f.api_version = i.fabric_attr.api_version;
    }
    Ok(())
}

/// A Rust string from a C one (NULL: empty).
///
/// # Safety
/// `s` is NULL or a NUL-terminated string.
unsafe fn string(s: *const c_char) -> Result<String> {
    if s.is_null() {
        return Ok(String::new());
    }
    // SAFETY: the caller's contract.
    unsafe { CStr::from_ptr(s) }
        .to_str()
        .map(str::to_string)
        .map_err(|_| Error::new(errno::EINVAL, "a name in the hints is not UTF-8"))
}

/// Longer than any address format rverbs knows (a `sockaddr_storage` is 128 bytes): a
/// length past it is refused before anything is read, since no buffer of that size was
/// meant (a C caller's `SIZE_MAX` would otherwise become a slice past `isize::MAX`).
const MAX_ADDRLEN: usize = 4096;

fn check_addrlen(len: usize) -> Result<()> {
    if len > MAX_ADDRLEN {
        return Err(Error::new(
            errno::EINVAL,
            format!("an address length of {len} bytes: no address format is that long"),
        ));
    }
    Ok(())
}

/// An address from C memory (NULL or 0 bytes: none).
///
/// # Safety
/// `p` is NULL or points at `len` readable bytes (a `len` over `MAX_ADDRLEN` is refused).
unsafe fn addr(p: *const libc::c_void, len: usize) -> Result<Option<std::net::SocketAddr>> {
    if p.is_null() || len == 0 {
        return Ok(None);
    }
    check_addrlen(len)?;
    // SAFETY: the caller's contract.
    let b = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    parse_sockaddr(b).map(Some)
}

/// The RDM endpoint name at `p` (NULL, or not one: `None`).
///
/// # Safety
/// `p` is NULL or points at `len` readable bytes.
unsafe fn rdm_name(p: *const libc::c_void, len: usize) -> Result<Option<Vec<u8>>> {
    if p.is_null() || len != crate::core::rdm::RdmName::LEN {
        return Ok(None);
    }
    // SAFETY: the caller's contract.
    let b = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    Ok(crate::core::rdm::RdmName::parse(b).ok().map(|_| b.to_vec()))
}

/// Checks that an `FI_ADDR_IB_UD` address (NULL: none) is a datagram endpoint name.
///
/// # Safety
/// `p` is NULL or points at `len` readable bytes.
unsafe fn ud_name(p: *const libc::c_void, len: usize, what: &str) -> Result<()> {
    if p.is_null() || len == 0 {
        return Ok(());
    }
    check_addrlen(len)?;
    // SAFETY: the caller's contract.
    let b = unsafe { std::slice::from_raw_parts(p.cast::<u8>(), len) };
    crate::verbs::UdName::parse(b)
        .map(|_| ())
        .map_err(|e| Error::new(errno::EINVAL, format!("{what}: {e}")))
}

fn enum_of<T>(v: u32, from: fn(u32) -> Option<T>, what: &str) -> Result<T> {
    from(v).ok_or_else(|| Error::new(errno::EINVAL, format!("{what} {v} is not a known value")))
}

/// The hints (or any `fi_info`) an application passed, as Rust data. NULL attribute
/// pointers read as defaults.
///
/// # Safety
/// `p` points at a valid `fi_info` whose non-NULL parts are valid.
pub unsafe fn from_c(p: *const fi::fi_info) -> Result<Info> {
    // SAFETY: the caller's contract; each attribute pointer is checked for NULL.
    unsafe {
        let o = &*p;
        let addr_format = enum_of(o.addr_format, AddrFormat::from_raw, "addr_format")?;
        // Datagram names (FI_ADDR_IB_UD) go into address vectors, not into fi_info: a hint
        // carrying one (fi_pingpong's client copies the server's) is checked and set aside.
        let mut dest_name = None;
        let (src_addr, dest_addr) = if addr_format == AddrFormat::IbUd {
            ud_name(o.src_addr, o.src_addrlen, "src_addr")?;
            ud_name(o.dest_addr, o.dest_addrlen, "dest_addr")?;
            (None, None)
        } else if addr_format == AddrFormat::Unspec
            && (rdm_name(o.src_addr, o.src_addrlen)?.is_some()
                || rdm_name(o.dest_addr, o.dest_addrlen)?.is_some())
        {
            // RDM names (FI_FORMAT_UNSPEC, fi_pingpong's client copies the server's): the
            // destination is kept in its own form; a source one names a listener the
            // endpoint chooses itself.
            dest_name = rdm_name(o.dest_addr, o.dest_addrlen)?;
            (None, None)
        } else {
            (
                addr(o.src_addr, o.src_addrlen)?,
                addr(o.dest_addr, o.dest_addrlen)?,
            )
        };
        let mut i = Info {
            caps: Flags::from_bits_retain(o.caps),
            mode: Mode::from_bits_retain(o.mode),
            addr_format,
            src_addr,
            dest_addr,
            dest_name,
            ..Default::default()
        };
        if let Some(t) = o.tx_attr.as_ref() {
            i.tx_attr = TxAttr {
                caps: Flags::from_bits_retain(t.caps),
                mode: Mode::from_bits_retain(t.mode),
                op_flags: Flags::from_bits_retain(t.op_flags),
                msg_order: t.msg_order,
                comp_order: t.comp_order,
                inject_size: t.inject_size,
                size: t.size,
                iov_limit: t.iov_limit,
                rma_iov_limit: t.rma_iov_limit,
            };
        }
        if let Some(r) = o.rx_attr.as_ref() {
            i.rx_attr = rx_attr(r);
        }
        if let Some(e) = o.ep_attr.as_ref() {
            i.ep_attr = EpAttr {
                ep_type: enum_of(e.type_, EpType::from_raw, "ep_attr.type")?,
                protocol: e.protocol,
                protocol_version: e.protocol_version,
                max_msg_size: e.max_msg_size,
                msg_prefix_size: e.msg_prefix_size,
                max_order_raw_size: e.max_order_raw_size,
                max_order_war_size: e.max_order_war_size,
                max_order_waw_size: e.max_order_waw_size,
                mem_tag_format: e.mem_tag_format,
                tx_ctx_cnt: e.tx_ctx_cnt,
                rx_ctx_cnt: e.rx_ctx_cnt,
            };
        }
        if let Some(d) = o.domain_attr.as_ref() {
            i.domain_attr = DomainAttr {
                name: string(d.name)?,
                threading: enum_of(d.threading, Threading::from_raw, "threading")?,
                control_progress: enum_of(
                    d.control_progress,
                    Progress::from_raw,
                    "control_progress",
                )?,
                data_progress: enum_of(d.data_progress, Progress::from_raw, "data_progress")?,
                resource_mgmt: enum_of(d.resource_mgmt, ResourceMgmt::from_raw, "resource_mgmt")?,
                av_type: enum_of(d.av_type, AvType::from_raw, "av_type")?,
                mr_mode: MrMode::from_bits_retain(d.mr_mode as u32),
                mr_key_size: d.mr_key_size,
                cq_data_size: d.cq_data_size,
                cq_cnt: d.cq_cnt,
                ep_cnt: d.ep_cnt,
                tx_ctx_cnt: d.tx_ctx_cnt,
                rx_ctx_cnt: d.rx_ctx_cnt,
                max_ep_tx_ctx: d.max_ep_tx_ctx,
                max_ep_rx_ctx: d.max_ep_rx_ctx,
                max_ep_stx_ctx: d.max_ep_stx_ctx,
                max_ep_srx_ctx: d.max_ep_srx_ctx,
                cntr_cnt: d.cntr_cnt,
                mr_iov_limit: d.mr_iov_limit,
                caps: Flags::from_bits_retain(d.caps),
                mode: Mode::from_bits_retain(d.mode),
                max_err_data: d.max_err_data,
                mr_cnt: d.mr_cnt,
            };
        }
        if let Some(f) = o.fabric_attr.as_ref() {
            i.fabric_attr = fabric_attr(f)?;
        }
        Ok(i)
    }
}

/// `struct fi_rx_attr` as Rust data.
pub fn rx_attr(r: &fi::fi_rx_attr) -> RxAttr {
    RxAttr {
        caps: Flags::from_bits_retain(r.caps),
        mode: Mode::from_bits_retain(r.mode),
        op_flags: Flags::from_bits_retain(r.op_flags),
        msg_order: r.msg_order,
        comp_order: r.comp_order,
        total_buffered_recv: r.total_buffered_recv,
        size: r.size,
        iov_limit: r.iov_limit,
    }
}

/// `struct fi_fabric_attr` as Rust data.
///
/// # Safety
/// Its string pointers are NULL or NUL-terminated.
pub unsafe fn fabric_attr(f: &fi::fi_fabric_attr) -> Result<FabricAttr> {
    // SAFETY: the caller's contract.
    unsafe {
        Ok(FabricAttr {
            name: string(f.name)?,
            prov_name: string(f.prov_name)?,
            prov_version: f.prov_version,
            api_version: f.api_version,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Info {
        let mut i = Info {
            caps: Flags::MSG | Flags::SEND | Flags::RECV,
            mode: Mode::MSG_PREFIX,
            addr_format: AddrFormat::SockaddrIn,
            src_addr: Some("192.0.2.1:7471".parse().unwrap()),
            dest_addr: Some("192.0.2.2:18515".parse().unwrap()),
            ..Default::default()
        };
        i.tx_attr.inject_size = 512;
        i.tx_attr.size = 384;
        i.tx_attr.iov_limit = 32;
        i.rx_attr.size = 256;
        i.rx_attr.caps = Flags::MSG | Flags::RECV | Flags::MULTI_RECV;
        i.ep_attr.ep_type = EpType::Dgram;
        i.ep_attr.max_msg_size = 1024;
        i.ep_attr.msg_prefix_size = 40;
        i.domain_attr.name = "rxe0".into();
        i.domain_attr.threading = Threading::Safe;
        i.domain_attr.data_progress = Progress::Manual;
        i.domain_attr.av_type = AvType::Table;
        i.domain_attr.mr_mode = MrMode::LOCAL | MrMode::VIRT_ADDR;
        i.domain_attr.cq_data_size = 4;
        i.fabric_attr.name = "IB-0xfe80000000000000".into();
        i.fabric_attr.prov_version = 1;
        i.fabric_attr.api_version = rfabric_sys::fabric::RFABRIC_FI_VERSION;
        i
    }

    fn same(a: &Info, b: &Info) -> bool {
        (a.caps, a.mode, a.addr_format, a.src_addr, a.dest_addr)
            == (b.caps, b.mode, b.addr_format, b.src_addr, b.dest_addr)
            && a.tx_attr == b.tx_attr
            && a.rx_attr == b.rx_attr
            && a.ep_attr == b.ep_attr
            && a.domain_attr == b.domain_attr
            && a.fabric_attr == b.fabric_attr
    }

    #[test]
    fn address_lengths_past_any_address_are_refused_before_reading() {
        let mut byte = 0u8;
        for len in [MAX_ADDRLEN + 1, 1 << 40, isize::MAX as usize, usize::MAX] {
            // SAFETY: plain data; zero is valid.
            let mut h: fi::fi_info = unsafe { std::mem::zeroed() };
            h.addr_format = fi::FI_SOCKADDR_IN;
            h.src_addr = (&mut byte as *mut u8).cast();
            h.src_addrlen = len;
            // SAFETY: the length lies, and from_c must refuse it without reading.
            let e = unsafe { from_c(&h) }.unwrap_err();
            assert_eq!(e.errno(), errno::EINVAL, "src_addrlen {len}");
            h.src_addrlen = 0;
            h.addr_format = fi::FI_ADDR_IB_UD;
            h.dest_addr = (&mut byte as *mut u8).cast();
            h.dest_addrlen = len;
            // SAFETY: as above.
            let e = unsafe { from_c(&h) }.unwrap_err();
            assert_eq!(e.errno(), errno::EINVAL, "dest_addrlen {len}");
        }
    }

    #[test]
    fn infos_round_trip_and_libfabric_duplicates_and_frees_ours() {
        let i = sample();
        let c = to_c(&i).unwrap();
        // SAFETY: c is a valid fi_info of ours.
        let back = unsafe { from_c(c) }.unwrap();
        assert!(same(&i, &back), "{i:?}\n{back:?}");
        // SAFETY: as above; prov_name is NULL for the core, and the address is a sockaddr_in.
        unsafe {
            assert!((*(*c).fabric_attr).prov_name.is_null());
            assert_eq!((*c).src_addrlen, 16);
            // libfabric's own allocator copies it and frees both: the layout is the core's.
            let dup = fi::fi_dupinfo(c);
            assert!(!dup.is_null());
            let d = from_c(dup).unwrap();
            assert!(same(&i, &d));
            fi::fi_freeinfo(dup);
            fi::fi_freeinfo(c);
        }
    }

    #[test]
    fn lists_link_in_order_and_bad_hints_are_einval() {
        let mut a = sample();
        let mut b = sample();
        a.domain_attr.name = "first".into();
        b.domain_attr.name = "second".into();
        let l = list_to_c(&[a, b]).unwrap();
        // SAFETY: l is a two-element list of ours.
        unsafe {
            assert_eq!(from_c(l).unwrap().domain_attr.name, "first");
            assert_eq!(from_c((*l).next).unwrap().domain_attr.name, "second");
            assert!((*(*l).next).next.is_null());
            // An unknown endpoint type in hints is refused, not guessed.
            (*(*l).ep_attr).type_ = 999;
            assert_eq!(from_c(l).unwrap_err().errno(), errno::EINVAL);
            fi::fi_freeinfo(l);
        }
        assert!(list_to_c(&[]).unwrap().is_null());
    }
}
