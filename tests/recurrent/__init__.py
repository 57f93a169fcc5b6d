"""Tests of the recurrent mixers' math against their float64 step-by-step definitions."""
