"""The test suite, laid out like the package: tests/test_<module>.py holds the tests of
clipscale/<module>.py, tests/data/ those of clipscale/data/ (and so on); tests/trainer/ runs
train.py end to end, tests/scripts/ the scripts; tests/helpers/ holds what they share."""
