//! The allocator (mimalloc), counting the bytes held: the memory per tracked run is measured, not
//! guessed (a resident-set delta is hidden by memory the process freed earlier and reuses).
//!
//! mimalloc rather than the system's: the batch fold builds a JSON tree per event and frees them per
//! batch, and glibc's malloc and free were ~18% of its instructions (callgrind); with mimalloc the fold
//! took ~17% less time per event (bench.core's batch function, 3 runs each, 2026-12-02).

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};

use mimalloc::MiMalloc as System;

struct Counting;

static HELD: AtomicUsize = AtomicUsize::new(0);

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes currently allocated through Rust's allocator in this library.
pub fn allocated() -> usize {
    HELD.load(Relaxed)
}

// SAFETY: every call is forwarded to mimalloc (`System` here) unchanged; only a counter is updated beside it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let ptr = System.alloc(layout);
        if !ptr.is_null() {
            HELD.fetch_add(layout.size(), Relaxed);
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let ptr = System.alloc_zeroed(layout);
        if !ptr.is_null() {
            HELD.fetch_add(layout.size(), Relaxed);
        }
        ptr
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        HELD.fetch_sub(layout.size(), Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let moved = System.realloc(ptr, layout, new_size);
        if !moved.is_null() {
            HELD.fetch_add(new_size, Relaxed);
            HELD.fetch_sub(layout.size(), Relaxed);
        }
        moved
    }
}
