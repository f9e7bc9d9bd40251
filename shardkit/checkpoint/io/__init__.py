"""The ways out of the process: ``Storage`` (every byte through fsspec, with retries and atomic
commits), direct I/O on local disks, and the process-group helper (``dist``)."""
