"""Tests of recipes.common: the helpers the recipes share."""
