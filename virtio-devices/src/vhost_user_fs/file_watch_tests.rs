//! The watch alone: which files it hands back as shrunk, how many sizes it
//! reads for it, and its budget.

use std::os::unix::fs::FileExt;

use vmm_sys_util::tempfile::TempFile;

use super::*;

const PAGE: u64 = 4096;

fn file_of(pages: u64) -> TempFile {
    let f = TempFile::new().unwrap();
    f.as_file().set_len(pages * PAGE).unwrap();
    f
}

fn follow(w: &FileWatch, key: FileKey, f: &TempFile) {
    let size = f.as_file().metadata().unwrap().len();
    w.follow(key, Arc::new(f.as_file().try_clone().unwrap()), size);
}

#[test]
fn only_a_shrink_is_handed_back_and_each_file_is_read_once() {
    let w = FileWatch::new(Arc::new(WatchBudget::new(8)));
    let (a, b) = (file_of(4), file_of(4));
    follow(&w, (1, 1), &a);
    follow(&w, (1, 2), &b);
    assert_eq!(w.followed(), (2, 2));
    // Writes alternating between the two files queue 2000 events (the
    // kernel merges only repeats of the last one): two reads of a size.
    for i in 0..1000 {
        a.as_file().write_at(b"x", i).unwrap();
        b.as_file().write_at(b"y", i).unwrap();
    }
    assert!(w.shrunk_after_events().is_empty(), "nothing shrank");
    assert_eq!(w.size_checks(), 2);
    // Growing is not shrinking; shrinking below what was seen is.
    a.as_file().set_len(8 * PAGE).unwrap();
    assert!(w.shrunk_after_events().is_empty());
    a.as_file().set_len(6 * PAGE).unwrap();
    assert_eq!(w.shrunk_after_events(), vec![(1, 1)]);
    assert!(w.shrunk_after_events().is_empty(), "handed back once");
    // Unfollowed: no more events, the watch goes back to the budget.
    w.unfollow((1, 1));
    a.as_file().set_len(0).unwrap();
    assert!(w.shrunk_after_events().is_empty());
    assert_eq!((w.followed(), w.budget.used()), ((1, 1), 1));
    drop(w);
}

/// A file grows, is mapped further (the map saw it longer) and shrinks
/// back before the events are read: the size last read is the old one, yet
/// the new mapping's pages are gone, so it counts as shrunk.
#[test]
fn a_shrink_back_below_what_a_new_mapping_saw_is_a_shrink() {
    let w = FileWatch::new(Arc::new(WatchBudget::new(8)));
    let f = file_of(8);
    follow(&w, (2, 1), &f);
    f.as_file().set_len(10 * PAGE).unwrap();
    w.saw_size((2, 1), 10 * PAGE);
    f.as_file().set_len(8 * PAGE).unwrap();
    assert_eq!(w.shrunk_after_events(), vec![(2, 1)]);
}

/// Past its budget a file gets no watch (counted); its shrink is found by
/// the once-a-second read instead, and watches given back serve others.
#[test]
fn files_past_the_budget_are_read_every_tick() {
    let budget = Arc::new(WatchBudget::new(1));
    let w = FileWatch::new(budget.clone());
    let (a, b) = (file_of(4), file_of(4));
    follow(&w, (3, 1), &a);
    follow(&w, (3, 2), &b);
    assert_eq!(w.followed(), (2, 1));
    assert_eq!(w.refused(), 1);
    b.as_file().set_len(PAGE).unwrap();
    assert!(w.shrunk_after_events().is_empty(), "b has no watch");
    assert_eq!(w.shrunk_unwatched(), vec![(3, 2)]);
    assert!(w.shrunk_unwatched().is_empty());
    w.unfollow((3, 1));
    assert_eq!(budget.used(), 0);
    let c = file_of(1);
    follow(&w, (3, 3), &c);
    assert_eq!(w.followed(), (2, 1));
    drop(w);
    assert_eq!(budget.used(), 0, "a dropped watch gives everything back");
}
