"""Test instruments shipped with moe-ft (usable by users' own CI): the communication-rule checker."""
