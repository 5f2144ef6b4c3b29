"""Headless Chromium through selenium for the tests that drive pages: the review site and Label
Studio's labelling page. Missing, those tests are skipped with a message; under CI (``CI`` set) a
missing browser fails instead: CI installs Debian's chromium and chromium-driver (make browser)."""

from __future__ import annotations

import os
import shutil

import pytest


def chromium_driver():
    chrome, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (chrome and driver):
        if os.environ.get("CI"):
            pytest.fail("CI must install Debian's chromium and chromium-driver (see .ci/run)")
        pytest.skip("chromium / chromedriver not installed (apt-get install chromium chromium-driver)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chrome
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--no-first-run",
                "--window-size=1200,900"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)
