//! `fi_atomic(3)`: which atomic operations rverbs carries, and how each maps onto what the
//! device does. Verbs devices perform two atomics on one aligned 8-byte word:
//! fetch-and-add and compare-and-swap. `FI_SUM` and `FI_CSWAP` on 64-bit integers are those
//! directly. Every other operation on an element of 1, 2, 4 or 8 bytes (integers, `float`,
//! `double`) is done on the aligned word that holds it: the initiator reads the word (a
//! fetch-and-add of 0), computes the new word, and swaps it in with compare-and-swap,
//! again from the value the swap found until one succeeds. Each step is the device's own
//! atomic, so the operation is atomic with respect to every other atomic on that word.
//! Complex and wider types are `-FI_EOPNOTSUPP`, which fi_atomic(3) tells applications to
//! emulate. One element per call.

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
    /// Fetch-and-add of this value (`FI_SUM` on a 64-bit integer).
    FetchAdd(u64),
    /// Compare-and-swap: `compare`, `swap` (`FI_CSWAP` on a 64-bit integer).
    CmpSwap(u64, u64),
    /// Read, compute and swap on the word holding the element (`Emulated::next`).
    Emulated(Emulated),
}

/// An operation done on the 8-byte word that holds its element, by compare-and-swap.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Emulated {
    pub datatype: Datatype,
    pub op: AtomicOp,
    /// The element's first byte in the word (its address modulo 8).
    pub shift: u8,
    pub operand: [u8; 8],
    pub compare: [u8; 8],
}

/// `struct fi_atomic_attr`: elements per call and the datatype's size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AtomicAttr {
    pub count: usize,
    pub size: usize,
}

/// The numeric class of a datatype, which decides the operations it takes.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Class {
    Int,
    Float,
    None,
}

fn class(dt: Datatype) -> Class {
    match dt {
        Datatype::Float | Datatype::Double => Class::Float,
        d if d.size() <= 8 && d != Datatype::FloatComplex => Class::Int,
        _ => Class::None,
    }
}

/// Whether rverbs carries `op` on `dt` in calls of `kind` (`fi_atomicvalid`,
/// `fi_fetch_atomicvalid`, `fi_compare_atomicvalid`, `fi_query_atomic`).
pub fn valid(kind: AtomicKind, dt: Datatype, op: AtomicOp) -> Result<AtomicAttr> {
    use AtomicOp::*;
    let c = class(dt);
    let ok = c != Class::None
        && match (kind, op) {
            (AtomicKind::Base | AtomicKind::Fetch, Min | Max | Sum | Prod | Lor | Land | Lxor) => {
                true
            }
            (AtomicKind::Base | AtomicKind::Fetch, Write) => true,
            (AtomicKind::Base | AtomicKind::Fetch, Bor | Band | Bxor) => c == Class::Int,
            (AtomicKind::Fetch, Read) => true,
            (AtomicKind::Compare, Cswap | CswapNe | CswapLe | CswapLt | CswapGe | CswapGt) => true,
            (AtomicKind::Compare, Mswap) => c == Class::Int,
            _ => false,
        };
    if !ok {
        return Err(Error::new(
            errno::EOPNOTSUPP,
            format!(
                "{kind:?} atomic {op:?} on {dt:?}: not offered (fi_atomic(3)'s operations on \
                 integers, float and double; complex and 16-byte types are not)"
            ),
        ));
    }
    Ok(AtomicAttr {
        count: 1,
        size: dt.size(),
    })
}

/// The device operation for a call of `kind` with `count` elements at remote address
/// `addr`, and the address of the word it works on: the operand and the compare value are
/// the first element of `operand` and `compare` (host byte order). Checks what [`valid`]
/// does, the count and the element's alignment.
pub fn plan(
    kind: AtomicKind,
    dt: Datatype,
    op: AtomicOp,
    count: usize,
    operand: Option<[u8; 8]>,
    compare: Option<[u8; 8]>,
    addr: u64,
) -> Result<(DeviceAtomic, u64)> {
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
    let size = attr.size as u64;
    if addr % size != 0 {
        return Err(Error::new(
            errno::EINVAL,
            format!("an atomic on a {size}-byte element at {addr:#x}: elements are aligned"),
        ));
    }
    let need = |b: Option<[u8; 8]>, what: &str| {
        b.ok_or_else(|| {
            Error::new(
                errno::EINVAL,
                format!("an atomic {op:?} without its {what} buffer"),
            )
        })
    };
    let operand = match op {
        AtomicOp::Read => [0; 8],
        _ => need(operand, "operand")?,
    };
    let compare = match kind {
        AtomicKind::Compare => need(compare, "compare")?,
        _ => [0; 8],
    };
    let word = u64::from_ne_bytes;
    let int64 = matches!(dt, Datatype::Int64 | Datatype::Uint64);
    Ok(match op {
        AtomicOp::Sum if int64 => (DeviceAtomic::FetchAdd(word(operand)), addr),
        AtomicOp::Cswap if int64 => (DeviceAtomic::CmpSwap(word(compare), word(operand)), addr),
        _ => (
            DeviceAtomic::Emulated(Emulated {
                datatype: dt,
                op,
                shift: (addr % 8) as u8,
                operand,
                compare,
            }),
            addr - addr % 8,
        ),
    })
}

impl Emulated {
    /// The element's bytes in `word` (the word's memory image, host byte order).
    pub fn element(&self, word: u64) -> [u8; 8] {
        let b = word.to_ne_bytes();
        let (at, n) = (self.shift as usize, self.datatype.size());
        let mut e = [0u8; 8];
        e[..n].copy_from_slice(&b[at..at + n]);
        e
    }

    /// The word to swap in for `word`, or `None` when the operation leaves it as it is
    /// (a read, a compare that fails, a minimum already smaller): then reading it was the
    /// whole operation.
    pub fn next(&self, word: u64) -> Option<u64> {
        let cur = self.element(word);
        let new = apply(self.datatype, self.op, cur, self.operand, self.compare)?;
        let n = self.datatype.size();
        if new[..n] == cur[..n] {
            return None;
        }
        let mut b = word.to_ne_bytes();
        let at = self.shift as usize;
        b[at..at + n].copy_from_slice(&new[..n]);
        Some(u64::from_ne_bytes(b))
    }
}

/// An element type the operations work on: its arithmetic (wrapping for integers) and
/// its bitwise operations (none for floating point, where `valid` offers none).
trait Elem: Copy + PartialOrd + Sized {
    const N: usize;
    const ZERO: Self;
    const ONE: Self;
    fn get(b: [u8; 8]) -> Self;
    fn put(self) -> [u8; 8];
    fn sum(self, x: Self) -> Self;
    fn prod(self, x: Self) -> Self;
    /// `FI_BOR`, `FI_BAND`, `FI_BXOR`, `FI_MSWAP` (with `c` as the mask).
    fn bits(op: AtomicOp, a: Self, x: Self, c: Self) -> Self;
}

macro_rules! elem {
    ($t:ty, $zero:expr, $one:expr, $sum:ident, $prod:ident, |$op:ident, $a:ident, $x:ident, $c:ident| $bits:expr) => {
        impl Elem for $t {
            const N: usize = std::mem::size_of::<$t>();
            const ZERO: Self = $zero;
            const ONE: Self = $one;
            fn get(b: [u8; 8]) -> Self {
                <$t>::from_ne_bytes(b[..Self::N].try_into().unwrap_or_default())
            }
            fn put(self) -> [u8; 8] {
                let mut out = [0u8; 8];
                out[..Self::N].copy_from_slice(&self.to_ne_bytes());
                out
            }
            fn sum(self, x: Self) -> Self {
                self.$sum(x)
            }
            fn prod(self, x: Self) -> Self {
                self.$prod(x)
            }
            fn bits($op: AtomicOp, $a: Self, $x: Self, $c: Self) -> Self {
                $bits
            }
        }
    };
    (int $($t:ty),*) => {$(
        elem!($t, 0, 1, wrapping_add, wrapping_mul, |op, a, x, c| match op {
            AtomicOp::Bor => a | x,
            AtomicOp::Band => a & x,
            AtomicOp::Bxor => a ^ x,
            AtomicOp::Mswap => (x & c) | (a & !c),
            _ => a,
        });
    )*};
    (float $($t:ty),*) => {$(
        elem!($t, 0.0, 1.0, add, mul, |_op, a, _x, _c| a);
    )*};
}

use std::ops::{Add, Mul};
elem!(int i8, u8, i16, u16, i32, u32, i64, u64);
elem!(float f32, f64);

/// `op` on element `a` with operand `x` and compare value `c`, as fi_atomic(3) defines it;
/// `None` for a read.
fn apply_elem<T: Elem>(op: AtomicOp, a: T, x: T, c: T) -> Option<T> {
    let truth = |t: bool| if t { T::ONE } else { T::ZERO };
    let on = |v: T| v != T::ZERO;
    let swap_if = |hold: bool| if hold { x } else { a };
    Some(match op {
        AtomicOp::Min => swap_if(x < a),
        AtomicOp::Max => swap_if(x > a),
        AtomicOp::Sum => a.sum(x),
        AtomicOp::Prod => a.prod(x),
        AtomicOp::Lor => truth(on(a) || on(x)),
        AtomicOp::Land => truth(on(a) && on(x)),
        AtomicOp::Lxor => truth(on(a) != on(x)),
        AtomicOp::Bor | AtomicOp::Band | AtomicOp::Bxor | AtomicOp::Mswap => T::bits(op, a, x, c),
        AtomicOp::Read => return None,
        AtomicOp::Write => x,
        AtomicOp::Cswap => swap_if(c == a),
        AtomicOp::CswapNe => swap_if(c != a),
        AtomicOp::CswapLe => swap_if(c <= a),
        AtomicOp::CswapLt => swap_if(c < a),
        AtomicOp::CswapGe => swap_if(c >= a),
        AtomicOp::CswapGt => swap_if(c > a),
    })
}

/// `op` on element `cur` with `operand` and `compare` (fi_atomic(3)'s definitions), as
/// `dt`: the new element, or `None` for a read.
fn apply(
    dt: Datatype,
    op: AtomicOp,
    cur: [u8; 8],
    operand: [u8; 8],
    compare: [u8; 8],
) -> Option<[u8; 8]> {
    fn on<T: Elem>(op: AtomicOp, cur: [u8; 8], x: [u8; 8], c: [u8; 8]) -> Option<[u8; 8]> {
        apply_elem(op, T::get(cur), T::get(x), T::get(c)).map(T::put)
    }
    match dt {
        Datatype::Int8 => on::<i8>(op, cur, operand, compare),
        Datatype::Uint8 => on::<u8>(op, cur, operand, compare),
        Datatype::Int16 => on::<i16>(op, cur, operand, compare),
        Datatype::Uint16 => on::<u16>(op, cur, operand, compare),
        Datatype::Int32 => on::<i32>(op, cur, operand, compare),
        Datatype::Uint32 => on::<u32>(op, cur, operand, compare),
        Datatype::Int64 => on::<i64>(op, cur, operand, compare),
        Datatype::Uint64 => on::<u64>(op, cur, operand, compare),
        Datatype::Float => on::<f32>(op, cur, operand, compare),
        Datatype::Double => on::<f64>(op, cur, operand, compare),
        // Not offered (`valid`): left as it is.
        _ => Some(cur),
    }
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
    fn integers_float_and_double_take_their_operations_wider_types_none() {
        use AtomicKind::*;
        use AtomicOp::*;
        let mut n = 0;
        for kind in [Base, Fetch, Compare] {
            for dt in Datatype::ALL {
                for op in AtomicOp::ALL {
                    let r = valid(kind, dt, op);
                    let float = matches!(dt, Datatype::Float | Datatype::Double);
                    let int = dt.size() <= 8 && !float && dt != Datatype::FloatComplex;
                    let want = (int || float)
                        && match (kind, op) {
                            (Compare, Cswap | CswapNe | CswapLe | CswapLt | CswapGe | CswapGt) => {
                                true
                            }
                            (Compare, Mswap) => int,
                            (Compare, _) | (Base, Read) => false,
                            (_, Bor | Band | Bxor) => int,
                            (
                                _,
                                Mswap | Cswap | CswapNe | CswapLe | CswapLt | CswapGe | CswapGt,
                            ) => false,
                            _ => true,
                        };
                    match r {
                        Ok(a) => {
                            assert!(want, "{kind:?} {dt:?} {op:?}");
                            assert_eq!(
                                a,
                                AtomicAttr {
                                    count: 1,
                                    size: dt.size()
                                }
                            );
                            n += 1;
                        }
                        Err(e) => {
                            assert!(!want, "{kind:?} {dt:?} {op:?}");
                            assert_eq!(e.errno(), errno::EOPNOTSUPP);
                        }
                    }
                }
            }
        }
        // 8 integer types and 2 floating: base 11 and 8 ops, fetch 12 and 9, compare 7 and 6.
        assert_eq!(n, 8 * (11 + 12 + 7) + 2 * (8 + 9 + 6));
    }

    fn w(v: u64) -> Option<[u8; 8]> {
        Some(v.to_ne_bytes())
    }

    #[test]
    fn sixty_four_bit_sums_and_swaps_are_the_devices_the_rest_work_on_their_word() {
        let p = |k, dt, op, o, c, addr| plan(k, dt, op, 1, o, c, addr).unwrap();
        use AtomicKind::*;
        assert_eq!(
            p(Fetch, Datatype::Uint64, AtomicOp::Sum, w(5), None, 64),
            (DeviceAtomic::FetchAdd(5), 64)
        );
        assert_eq!(
            p(Compare, Datatype::Int64, AtomicOp::Cswap, w(9), w(3), 8),
            (DeviceAtomic::CmpSwap(3, 9), 8)
        );
        let (d, at) = p(Base, Datatype::Uint32, AtomicOp::Sum, w(1), None, 0x1004);
        assert_eq!(at, 0x1000);
        let DeviceAtomic::Emulated(e) = d else {
            panic!("{d:?}")
        };
        assert_eq!(e.shift, 4);
        // The word holds two u32s: the low one at shift 0, the one we add to at 4.
        let word = u64::from_ne_bytes([7, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        let next = e.next(word).unwrap();
        assert_eq!(
            next.to_ne_bytes(),
            [7, 0, 0, 0, 0, 0, 0, 0],
            "wraps within its element"
        );
        assert_eq!(e.element(word)[..4], [0xff; 4]);
        let e = |k, r: Result<(DeviceAtomic, u64)>| assert_eq!(r.unwrap_err().errno(), k);
        let base = Base;
        e(
            errno::EMSGSIZE,
            plan(base, Datatype::Int64, AtomicOp::Sum, 2, w(1), None, 0),
        );
        e(
            errno::EINVAL,
            plan(base, Datatype::Int64, AtomicOp::Sum, 0, w(1), None, 0),
        );
        e(
            errno::EINVAL,
            plan(base, Datatype::Int64, AtomicOp::Sum, 1, None, None, 0),
        );
        e(
            errno::EINVAL,
            plan(Compare, Datatype::Int64, AtomicOp::Cswap, 1, w(1), None, 0),
        );
        e(
            errno::EINVAL,
            plan(base, Datatype::Int32, AtomicOp::Sum, 1, w(1), None, 2),
        );
        e(
            errno::EOPNOTSUPP,
            plan(base, Datatype::LongDouble, AtomicOp::Sum, 1, w(1), None, 0),
        );
        assert!(plan(Fetch, Datatype::Int8, AtomicOp::Read, 1, None, None, 3).is_ok());
    }

    /// One operation on one element through the word that holds it.
    fn run(dt: Datatype, op: AtomicOp, cur: [u8; 8], x: [u8; 8], c: [u8; 8]) -> [u8; 8] {
        let kind = match op {
            AtomicOp::Cswap
            | AtomicOp::CswapNe
            | AtomicOp::CswapLe
            | AtomicOp::CswapLt
            | AtomicOp::CswapGe
            | AtomicOp::CswapGt
            | AtomicOp::Mswap => AtomicKind::Compare,
            _ => AtomicKind::Fetch,
        };
        let e = Emulated {
            datatype: dt,
            op,
            shift: 0,
            operand: x,
            compare: c,
        };
        assert!(valid(kind, dt, op).is_ok());
        let word = u64::from_ne_bytes(cur);
        e.element(e.next(word).unwrap_or(word))
    }

    fn b<T: Copy, const N: usize>(v: T, f: impl Fn(T) -> [u8; N]) -> [u8; 8] {
        let mut o = [0u8; 8];
        o[..N].copy_from_slice(&f(v));
        o
    }

    #[test]
    fn every_operation_does_what_fi_atomic_3_says() {
        use AtomicOp::*;
        let i = |v: i16| b(v, i16::to_ne_bytes);
        let t = Datatype::Int16;
        let cases = [
            (Min, -3, 5, 0, -3),
            (Min, 9, 5, 0, 5),
            (Max, -3, 5, 0, 5),
            (Sum, i16::MAX, 1, 0, i16::MIN),
            (Prod, -3, 5, 0, -15),
            (Lor, 0, 0, 0, 0),
            (Lor, 0, 7, 0, 1),
            (Land, 2, 7, 0, 1),
            (Land, 2, 0, 0, 0),
            (Lxor, 2, 7, 0, 0),
            (Lxor, 0, 7, 0, 1),
            (Bor, 0b1010, 0b0110, 0, 0b1110),
            (Band, 0b1010, 0b0110, 0, 0b0010),
            (Bxor, 0b1010, 0b0110, 0, 0b1100),
            (Read, 42, 0, 0, 42),
            (Write, 42, 7, 0, 7),
            (Cswap, 42, 7, 42, 7),
            (Cswap, 42, 7, 41, 42),
            (CswapNe, 42, 7, 41, 7),
            (CswapNe, 42, 7, 42, 42),
            (CswapLe, 42, 7, 42, 7),
            (CswapLe, 42, 7, 43, 42),
            (CswapLt, 42, 7, 41, 7),
            (CswapLt, 42, 7, 42, 42),
            (CswapGe, 42, 7, 42, 7),
            (CswapGe, 42, 7, 41, 42),
            (CswapGt, 42, 7, 43, 7),
            (CswapGt, 42, 7, 42, 42),
            (Mswap, 0b1100, 0b1010, 0b0110, 0b1010),
        ];
        for (op, cur, x, c, want) in cases {
            assert_eq!(
                run(t, op, i(cur), i(x), i(c)),
                i(want),
                "{op:?} {cur} {x} {c}"
            );
        }
        let f = |v: f64| b(v, f64::to_ne_bytes);
        let d = Datatype::Double;
        assert_eq!(run(d, Sum, f(1.5), f(2.25), f(0.0)), f(3.75));
        assert_eq!(run(d, Prod, f(1.5), f(-2.0), f(0.0)), f(-3.0));
        assert_eq!(run(d, Min, f(1.5), f(-2.0), f(0.0)), f(-2.0));
        assert_eq!(run(d, Lor, f(0.0), f(-2.0), f(0.0)), f(1.0));
        assert_eq!(run(d, CswapLt, f(3.0), f(9.0), f(2.5)), f(9.0));
        let g = |v: f32| b(v, f32::to_ne_bytes);
        assert_eq!(run(Datatype::Float, Max, g(1.5), g(2.5), g(0.0)), g(2.5));
        let u = |v: u8| b(v, |x: u8| [x]);
        assert_eq!(run(Datatype::Uint8, Sum, u(250), u(10), u(0)), u(4));
        assert_eq!(run(Datatype::Uint8, Min, u(250), u(10), u(0)), u(10));
        let s = |v: i8| b(v, i8::to_ne_bytes);
        assert_eq!(
            run(Datatype::Int8, Max, s(-5), s(-9), s(0)),
            s(-5),
            "signed compare"
        );
    }

    #[test]
    fn an_element_changes_only_its_own_bytes_of_the_word() {
        for shift in 0..8u8 {
            let e = Emulated {
                datatype: Datatype::Uint8,
                op: AtomicOp::Write,
                shift,
                operand: [0xab; 8],
                compare: [0; 8],
            };
            let word = u64::from_ne_bytes([1, 2, 3, 4, 5, 6, 7, 8]);
            let mut want = [1, 2, 3, 4, 5, 6, 7, 8];
            want[shift as usize] = 0xab;
            assert_eq!(e.next(word).unwrap().to_ne_bytes(), want);
            assert_eq!(e.element(word)[0], shift + 1);
        }
        // A write of what is there already changes nothing: reading was the operation.
        let e = Emulated {
            datatype: Datatype::Uint64,
            op: AtomicOp::Write,
            shift: 0,
            operand: 5u64.to_ne_bytes(),
            compare: [0; 8],
        };
        assert_eq!(e.next(5), None);
        assert_eq!(e.next(4), Some(5));
    }
}
