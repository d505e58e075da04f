"""Which saved expert files a resuming rank reads, and which placement it resumes with (hand-worked)."""

from dynmoe_dist.parallel.reshard import owner_files_needed, resume_placement
from dynmoe_dist.planning.placement import Placement


def test_owner_is_the_first_holder_and_files_needed_follow_it():
    # saved on 3 ranks: expert 0 on ranks 2 and 0 (owner 0), expert 1 on rank 1, expert 2 on rank 2
    saved = Placement(3, (((2, 0), (0, 0)), ((1, 0),), ((2, 1),)))
    assert [saved.owner(e) for e in range(3)] == [0, 1, 2]
    # resumed on 2 ranks: the default layout puts experts 0, 1 on rank 0 and expert 2 on rank 1
    new = resume_placement(saved, 2)
    assert new.experts_on(0) == [0, 1] and new.experts_on(1) == [2]
    assert owner_files_needed([saved], [new], 0) == [0, 1]  # expert 0 from rank 0's file, 1 from rank 1's
    assert owner_files_needed([saved], [new], 1) == [2]  # rank 1 reads one file of three
    assert resume_placement(saved, 3) is saved  # same ep size: the saved layout, replicas and all
