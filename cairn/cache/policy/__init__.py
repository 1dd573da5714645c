"""Pure policies of the cache: snapshot placement, retention, the resume planner and its measured speeds."""
