"""Records, codecs, configuration and errors: the types every other part of PRME shares."""
