"""The head: the segctl CLI today; the scheduler, planner and collector as the fleet lands."""
