"""The test suite, laid out like the package: tests/<area>/test_<module>.py holds the tests of clipscale/<area>/<module>.py."""
