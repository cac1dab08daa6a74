//! `fi_atomic(3)`: which atomic operations rverbs carries, and how each maps onto what the
//! device does. rverbs offers the operations verbs devices perform themselves on one 8-byte
//! word (fetch-and-add and compare-and-swap), plus the atomic read (a fetch-and-add of 0)
//! and write (an 8-byte RDMA write) that libfabric's verbs provider offers; every other
//! operation and datatype is `-FI_EOPNOTSUPP`, which fi_atomic(3) tells applications to
//! emulate. One element per call: the device's atomics take one word.

use crate::core::error::{errno, Error, Result};

/// `enum fi_op` (fi_domain.h), the atomic operations.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicOp {
    Min = 0,
    Max,
    Sum,
    Prod,
    Lor,
    Land,
    Bor,
    Band,
    Lxor,
    Bxor,
    Read,
    Write,
    Cswap,
    CswapNe,
    CswapLe,
    CswapLt,
    CswapGe,
    CswapGt,
    Mswap,
}

impl AtomicOp {
    const ALL: [AtomicOp; 19] = [
        AtomicOp::Min,
        AtomicOp::Max,
        AtomicOp::Sum,
        AtomicOp::Prod,
        AtomicOp::Lor,
        AtomicOp::Land,
        AtomicOp::Bor,
        AtomicOp::Band,
        AtomicOp::Lxor,
        AtomicOp::Bxor,
        AtomicOp::Read,
        AtomicOp::Write,
        AtomicOp::Cswap,
        AtomicOp::CswapNe,
        AtomicOp::CswapLe,
        AtomicOp::CswapLt,
        AtomicOp::CswapGe,
        AtomicOp::CswapGt,
        AtomicOp::Mswap,
    ];

    /// The operation of C's `enum fi_op` value `v`.
    pub fn from_raw(v: u32) -> Result<AtomicOp> {
        Self::ALL.get(v as usize).copied().ok_or_else(|| {
            Error::new(
                errno::EINVAL,
                format!("{v} is not an atomic operation (enum fi_op)"),
            )
        })
    }
}

/// `enum fi_datatype` (fi_domain.h), the atomic datatypes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Datatype {
    Int8 = 0,
    Uint8,
    Int16,
    Uint16,
    Int32,
    Uint32,
    Int64,
    Uint64,
    Float,
    Double,
    FloatComplex,
    DoubleComplex,
    LongDouble,
    LongDoubleComplex,
    Int128,
    Uint128,
}

impl Datatype {
    const ALL: [Datatype; 16] = [
        Datatype::Int8,
        Datatype::Uint8,
        Datatype::Int16,
        Datatype::Uint16,
        Datatype::Int32,
        Datatype::Uint32,
        Datatype::Int64,
        Datatype::Uint64,
        Datatype::Float,
        Datatype::Double,
        Datatype::FloatComplex,
        Datatype::DoubleComplex,
        Datatype::LongDouble,
        Datatype::LongDoubleComplex,
        Datatype::Int128,
        Datatype::Uint128,
    ];

    /// The datatype of C's `enum fi_datatype` value `v` (the collective-only `FI_VOID`
    /// and beyond are not atomic datatypes).
    pub fn from_raw(v: u32) -> Result<Datatype> {
        Self::ALL.get(v as usize).copied().ok_or_else(|| {
            Error::new(
                errno::EINVAL,
                format!("{v} is not an atomic datatype (enum fi_datatype)"),
            )
        })
    }

    /// Its size in bytes on this platform (`struct fi_atomic_attr::size`).
    pub fn size(self) -> usize {
        match self {
            Datatype::Int8 | Datatype::Uint8 => 1,
            Datatype::Int16 | Datatype::Uint16 => 2,
            Datatype::Int32 | Datatype::Uint32 | Datatype::Float => 4,
            Datatype::Int64 | Datatype::Uint64 | Datatype::Double | Datatype::FloatComplex => 8,
            Datatype::DoubleComplex
            | Datatype::LongDouble
            | Datatype::Int128
            | Datatype::Uint128 => 16,
            Datatype::LongDoubleComplex => 32,
        }
    }

    fn integer64(self) -> bool {
        matches!(self, Datatype::Int64 | Datatype::Uint64)
    }
}

/// The three families of atomic calls (and their valid calls): `fi_atomic*`,
/// `fi_fetch_atomic*`, `fi_compare_atomic*`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AtomicKind {
    Base,
    Fetch,
    Compare,
}

/// What the device does for a supported operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceAtomic {
    /// An 8-byte RDMA write of the operand (`FI_ATOMIC_WRITE`, as libfabric's verbs does).
    Write,
    /// Fetch-and-add of this value (`FI_SUM`; `FI_ATOMIC_READ` adds 0).
    FetchAdd(u64),
    /// Compare-and-swap: `compare`, `swap`.
    CmpSwap(u64, u64),
}

/// `struct fi_atomic_attr`: elements per call and the datatype's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtomicAttr {
    pub count: usize,
    pub size: usize,
}

/// Whether rverbs carries `op` on `dt` in calls of `kind` (`fi_atomicvalid`,
/// `fi_fetch_atomicvalid`, `fi_compare_atomicvalid`, `fi_query_atomic`).
pub fn valid(kind: AtomicKind, dt: Datatype, op: AtomicOp) -> Result<AtomicAttr> {
    let eight = dt.size() == 8 && !matches!(dt, Datatype::FloatComplex);
    let ok = match (kind, op) {
        // Arithmetic is the device's, on 64-bit integers only (its add is an integer add).
        (AtomicKind::Base | AtomicKind::Fetch, AtomicOp::Sum) => dt.integer64(),
        (AtomicKind::Compare, AtomicOp::Cswap) => dt.integer64(),
        // Reading or writing a word needs only its size.
        (AtomicKind::Fetch, AtomicOp::Read) | (AtomicKind::Base, AtomicOp::Write) => eight,
        _ => false,
    };
    if !ok {
        return Err(Error::new(
            errno::EOPNOTSUPP,
            format!(
                "{kind:?} atomic {op:?} on {dt:?}: rverbs carries the device's atomics only \
                 (FI_SUM on 64-bit integers, FI_CSWAP on 64-bit integers, FI_ATOMIC_READ and \
                 FI_ATOMIC_WRITE of 8-byte types)"
            ),
        ));
    }
    Ok(AtomicAttr {
        count: 1,
        size: dt.size(),
    })
}

/// The device operation for a call of `kind` with `count` elements: the operand and the
/// compare value are the first 8 bytes of `operand` and `compare` (little-endian, as the
/// host stores them). Checks what [`valid`] does, and the count.
pub fn plan(
    kind: AtomicKind,
    dt: Datatype,
    op: AtomicOp,
    count: usize,
    operand: Option<[u8; 8]>,
    compare: Option<[u8; 8]>,
) -> Result<DeviceAtomic> {
    let attr = valid(kind, dt, op)?;
    if count != attr.count {
        return Err(Error::new(
            if count == 0 {
                errno::EINVAL
            } else {
                errno::EMSGSIZE
            },
            format!("an atomic of {count} elements: rverbs takes exactly 1 per call"),
        ));
    }
    let word = |b: Option<[u8; 8]>, what: &str| {
        b.map(u64::from_ne_bytes).ok_or_else(|| {
            Error::new(
                errno::EINVAL,
                format!("an atomic {op:?} without its {what} buffer"),
            )
        })
    };
    Ok(match op {
        AtomicOp::Read => DeviceAtomic::FetchAdd(0),
        AtomicOp::Write => DeviceAtomic::Write,
        AtomicOp::Sum => DeviceAtomic::FetchAdd(word(operand, "operand")?),
        _ => DeviceAtomic::CmpSwap(word(compare, "compare")?, word(operand, "operand")?),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn raw_values_follow_the_header() {
        assert_eq!(AtomicOp::from_raw(2).unwrap(), AtomicOp::Sum);
        assert_eq!(AtomicOp::from_raw(10).unwrap(), AtomicOp::Read);
        assert_eq!(AtomicOp::from_raw(12).unwrap(), AtomicOp::Cswap);
        assert_eq!(AtomicOp::from_raw(18).unwrap(), AtomicOp::Mswap);
        assert_eq!(AtomicOp::from_raw(19).unwrap_err().errno(), errno::EINVAL);
        assert_eq!(Datatype::from_raw(7).unwrap(), Datatype::Uint64);
        assert_eq!(Datatype::from_raw(15).unwrap(), Datatype::Uint128);
        assert_eq!(Datatype::from_raw(16).unwrap_err().errno(), errno::EINVAL);
    }

    #[test]
    fn only_the_devices_atomics_are_valid() {
        let mut ok = Vec::new();
        for kind in [AtomicKind::Base, AtomicKind::Fetch, AtomicKind::Compare] {
            for dt in Datatype::ALL {
                for op in AtomicOp::ALL {
                    match valid(kind, dt, op) {
                        Ok(a) => {
                            assert_eq!(a, AtomicAttr { count: 1, size: 8 });
                            ok.push((kind, dt, op));
                        }
                        Err(e) => assert_eq!(e.errno(), errno::EOPNOTSUPP),
                    }
                }
            }
        }
        use AtomicKind::*;
        use AtomicOp::*;
        use Datatype::*;
        let want = vec![
            (Base, Int64, Sum),
            (Base, Int64, Write),
            (Base, Uint64, Sum),
            (Base, Uint64, Write),
            (Base, Double, Write),
            (Fetch, Int64, Sum),
            (Fetch, Int64, Read),
            (Fetch, Uint64, Sum),
            (Fetch, Uint64, Read),
            (Fetch, Double, Read),
            (Compare, Int64, Cswap),
            (Compare, Uint64, Cswap),
        ];
        assert_eq!(ok, want);
    }

    #[test]
    fn plans_take_one_element_and_their_operands() {
        let w = |v: u64| Some(v.to_ne_bytes());
        let p = plan(
            AtomicKind::Fetch,
            Datatype::Uint64,
            AtomicOp::Sum,
            1,
            w(5),
            None,
        );
        assert_eq!(p.unwrap(), DeviceAtomic::FetchAdd(5));
        let p = plan(
            AtomicKind::Fetch,
            Datatype::Double,
            AtomicOp::Read,
            1,
            None,
            None,
        );
        assert_eq!(p.unwrap(), DeviceAtomic::FetchAdd(0));
        let p = plan(
            AtomicKind::Compare,
            Datatype::Int64,
            AtomicOp::Cswap,
            1,
            w(9),
            w(3),
        );
        assert_eq!(p.unwrap(), DeviceAtomic::CmpSwap(3, 9));
        let p = plan(
            AtomicKind::Base,
            Datatype::Int64,
            AtomicOp::Write,
            1,
            w(1),
            None,
        );
        assert_eq!(p.unwrap(), DeviceAtomic::Write);
        let e = plan(
            AtomicKind::Base,
            Datatype::Int64,
            AtomicOp::Sum,
            2,
            w(1),
            None,
        );
        assert_eq!(e.unwrap_err().errno(), errno::EMSGSIZE);
        let e = plan(
            AtomicKind::Base,
            Datatype::Int64,
            AtomicOp::Sum,
            0,
            w(1),
            None,
        );
        assert_eq!(e.unwrap_err().errno(), errno::EINVAL);
        let e = plan(
            AtomicKind::Base,
            Datatype::Int64,
            AtomicOp::Sum,
            1,
            None,
            None,
        );
        assert_eq!(e.unwrap_err().errno(), errno::EINVAL);
        let e = plan(
            AtomicKind::Base,
            Datatype::Int32,
            AtomicOp::Sum,
            1,
            w(1),
            None,
        );
        assert_eq!(e.unwrap_err().errno(), errno::EOPNOTSUPP);
    }
}
