"""Memory-saving methods, one module each (shared helpers in `_*.py`). A method is any object
with the members `runner.Method` lists (no base class); one module plus one conf/method/*.yaml
adds a method, nothing else is edited."""
