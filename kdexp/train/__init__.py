"""kdexp.train"""
