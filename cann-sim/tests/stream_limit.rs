//! The stream limit of a device, in a process of its own so that no other
//! test's streams change the count.

mod common;

use common::*;

const ACL_ERROR_RT_NO_STREAM_RESOURCE: i32 = 207008;

#[test]
fn a_device_holds_at_most_1984_streams_with_its_default_one() {
    // aclrtCreateStream API reference (Atlas A2/A3): 1984 streams per device,
    // the default stream among them.
    let s = use_device(0);
    let mut streams: Vec<Ptr> = (0..1983).map(|_| stream()).collect();
    let mut extra = std::ptr::null_mut();
    unsafe {
        assert_eq!((s.aclrtCreateStream)(&mut extra), ACL_ERROR_RT_NO_STREAM_RESOURCE, "{}", err_msg());
        assert!(err_msg().contains("1984"), "{}", err_msg());
        assert!(extra.is_null(), "nothing written on failure");
    }
    // Another device has its own streams.
    std::thread::scope(|sc| {
        sc.spawn(|| {
            use_device(1);
            destroy_stream(stream());
        });
    });
    // A destroyed stream gives its place back.
    destroy_stream(streams.pop().expect("1983 streams"));
    streams.push(stream());
    streams.into_iter().for_each(destroy_stream);
}
