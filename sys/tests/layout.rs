//! The bindgen view of the libfabric 1.17 structs must match the C compiler's, field by field.

use rfabric_sys::fabric::layout::{c_value, rust_values};

#[test]
fn every_struct_size_and_field_offset_matches_the_c_compiler() {
    let mut checked = 0;
    for (name, rust) in rust_values() {
        let c = c_value(name).unwrap_or_else(|| panic!("{name} missing from the C table"));
        assert_eq!(
            *rust, c,
            "{name}: bindgen says {rust}, the C compiler says {c}"
        );
        checked += 1;
    }
    assert!(checked > 200, "only {checked} layout entries checked");
}

#[test]
fn peer_rx_entry_is_castable_to_a_dlist_entry() {
    // fi_ext.h: "Castable to dlist_entry" — next and prev come first.
    assert_eq!(c_value("fi_peer_rx_entry.next"), Some(0));
    assert_eq!(
        c_value("fi_peer_rx_entry.prev"),
        Some(std::mem::size_of::<usize>())
    );
}

#[test]
fn constants_bindgen_cannot_evaluate_have_their_header_values() {
    use rfabric_sys::fabric::*;
    assert_eq!(FI_ADDR_UNSPEC, u64::MAX);
    assert_eq!(RFABRIC_FI_VERSION, (1 << 16) | 17);
    assert_eq!(FI_MSG, 1 << 1);
    assert_eq!(FI_RECV, 1 << 10);
    assert_eq!(FI_SEND, 1 << 11);
}
